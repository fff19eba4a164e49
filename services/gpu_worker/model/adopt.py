"""A model that takes the loader's tensors as its parameters: one copy of the weights in memory, never two.

Built the usual way, a model allocates (and initialises) every parameter, and loading then copies the checkpoint's
tensors into them: for a moment the weights are in memory twice. For Qwen3-30B-A3B in bf16 (61 GB) that is 122 GB,
more than an 80 GB card holds, although the model itself fits with room for a KV pool. So the runner, when the
loaded tensors are its own, builds the model with its parameters on the meta device (no memory, no initialisation;
buffers such as RoPE's frequencies are built as usual), and the load adopts each tensor of the state dict as the
parameter of that name, where it is already on the device in the model's dtype, of the parameter's shape, and owns
its whole storage (a tensor-parallel slice is a view of the full tensor: adopting it would keep the full tensor
alive). Any other parameter is allocated then, and the load copies into it as before. A runner given tensors that
its caller keeps (to build a second engine from them) allocates every parameter that way: never initialised either
(nn.Linear's initialisation of an 8B model on the CPU took over a minute, for values the load overwrote).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within: every parameter a module registers is put on the meta device (buffers are left where they are built),
    so that building a model allocates and initialises no weight. It patches nn.Module for the whole process: a
    module that another thread builds meanwhile gets meta parameters too (a runner builds its model on one thread,
    and nothing else in a worker builds modules)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = register_on_meta  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]


def move_buffers_(model: nn.Module, device: torch.device) -> None:
    """The model's buffers onto `device`, in the dtype they were built in (its parameters, on meta, wait for the
    load)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


def adopt_parameters_(model: nn.Module, state_dict: dict[str, torch.Tensor], device: torch.device,
                      dtype: torch.dtype) -> int:
    """Give every meta parameter of `model` real memory before a load_state_dict: the state dict's tensor of its
    name itself where it can be (module docstring), else a new tensor on `device` (in `dtype` if the source is a
    floating tensor) for the load to copy into. → how many parameters were adopted, not copied."""
    num_adopted = 0
    for module_name, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is None or not param.is_meta:
                continue
            source = state_dict.get(f"{module_name}.{name}" if module_name else name)
            if source is not None and _adoptable(source, param, device, dtype):
                module._parameters[name] = nn.Parameter(source, requires_grad=False)
                num_adopted += 1
                continue
            wanted = dtype if source is None or source.is_floating_point() else source.dtype
            module._parameters[name] = nn.Parameter(torch.empty(param.shape, dtype=wanted, device=device),
                                                    requires_grad=False)
    return num_adopted


def _adoptable(source: torch.Tensor, param: nn.Parameter, device: torch.device, dtype: torch.dtype) -> bool:
    same_device = source.device.type == device.type and device.index in (None, source.device.index)
    return (same_device and source.dtype == dtype and source.shape == param.shape
            and source.is_contiguous() and source.storage_offset() == 0
            and source.untyped_storage().nbytes() == source.numel() * source.element_size())
