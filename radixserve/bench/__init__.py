"""`radixserve bench`: an open-loop load generator and report for any OpenAI-compatible server.

workloads.py builds the requests (exact token lengths, arrival schedules), sse.py parses streams,
client.py times one request, runner.py drives a run, metrics.py does the arithmetic, report.py and
plots.py write the table, JSON and PNGs; main.py is the command.
"""
