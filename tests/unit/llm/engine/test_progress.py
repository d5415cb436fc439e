"""Loading progress: a log line as each phase begins, and each phase's seconds in order."""
import logging

from kiln.llm.engine.progress import Progress


def test_each_phase_is_logged_as_it_begins_and_timed_until_the_next(caplog):
    log = logging.getLogger("kiln.test.progress")
    with caplog.at_level("INFO", logger="kiln.test.progress"):
        progress = Progress(log)
        progress.begin("reading the checkpoint", "/models/m.gguf")
        progress.begin("building the model")
        progress.end()
        progress.end()  # nothing running: no-op
    assert [r.getMessage() for r in caplog.records] == [
        "loading: reading the checkpoint /models/m.gguf ...", "loading: building the model ...",
    ]
    assert [name for name, _ in progress.phases] == ["reading the checkpoint", "building the model"]
    assert all(seconds >= 0 for _, seconds in progress.phases) and progress.total() >= sum(
        s for _, s in progress.phases)
    assert progress.summary().startswith("reading the checkpoint 0.0s, building the model 0.0s")
