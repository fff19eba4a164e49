"""Benchmarks: the offline engine benchmark here; the HTTP load generator comes with `radixserve bench`."""
