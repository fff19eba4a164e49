"""`radixserve bench`: an open-loop (or, for W6, closed-loop) load generator and report for any
OpenAI-compatible server.

workloads.py builds the requests (exact token lengths, arrival schedules), sse.py parses streams,
client.py times one request, runner.py drives a run, metrics.py does the arithmetic and the totals,
scrape.py reads a server's /metrics, timeline.py turns W6's samples into windows, report.py and
plots.py write the table, JSON and PNGs; main.py is the command.
"""
