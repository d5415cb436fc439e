"""`kiln analyze`: the model analyzer.

It searches the configuration space that matters for a model (space.py),
starting real `kiln serve` processes and driving them through their public
APIs with Kiln's load generators (driver.py, server.py, load.py), sweeping
each configuration's load until it saturates or breaks the SLOs (sweep.py),
pruning the search (search.py), keeping every point in a JSON-lines store
so a run resumes (store.py), and writing a report with plots (report.py,
plots.py) and the best configuration as a ready-to-use file (subject.py).
"""
