"""`kiln analyze` misuse that is only found at run time: still a one-line error."""

from __future__ import annotations

import pytest

from kiln.cli.main import main as kiln_main


def _repo(tmp_path):
    model = tmp_path / "repo" / "m"
    (model / "1").mkdir(parents=True)
    (model / "config.yaml").write_text("backend: onnxruntime\nmax_batch_size: 8\n")
    (model / "1" / "model.onnx").write_bytes(b"weights")
    return tmp_path / "repo"


@pytest.mark.parametrize("output, fragment", [
    ("results.txt", "exists and is not a directory"),
    ("results.txt/sub", "cannot create the directory"),
])
def test_an_output_path_that_is_a_file_is_a_usage_error(tmp_path, capsys, output, fragment):
    (tmp_path / "results.txt").write_text("not a directory")
    path = tmp_path / output
    code = kiln_main(["analyze", "--model-repository", str(_repo(tmp_path)), "--model-name", "m",
                      "--output", str(path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"kiln: error: --output {str(path)!r}") and fragment in err
    assert err.count("\n") == 1 and (tmp_path / "results.txt").read_text() == "not a directory"


@pytest.mark.parametrize("option, value, fragment", [
    ("--price-per-hour", "inf", "price_per_hour must be a positive, finite number"),
    ("--max-p99-latency-ms", "nan", "max_p99_latency_ms must be a positive, finite number"),
    ("--concurrency", "1,nan", "concurrency must be positive, finite, increasing numbers"),
    ("--concurrency", "1,inf", "concurrency must be positive, finite, increasing numbers"),
    ("--concurrency", "1.5", "concurrency must be whole numbers"),
    ("--level-duration-s", "inf", "level_duration_s must be in (0, 3600]"),
])
def test_impossible_numbers_are_refused_before_any_server_starts(tmp_path, capsys, option, value, fragment):
    # inf price: a traceback after the server refused it; NaN / inf levels: a traceback after the
    # first level; an infinite level never ended; 1.5 clients became 1.
    code = kiln_main(["analyze", "--model-repository", str(_repo(tmp_path)), "--model-name", "m",
                      "--output", str(tmp_path / "out"), option, value])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("kiln: error: ") and fragment in err and err.count("\n") == 1
