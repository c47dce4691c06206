"""What people run: the command line, `explain`, `diff`, `verify` and the HTML report.
"""
