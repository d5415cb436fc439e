"""Builds the tabular example: trains a small scikit-learn classifier on the
bundled breast-cancer data and exports it to ONNX with skl2onnx.

    python examples/tabular/build_repository.py [DEST]

`train()` is reused by the tests and the benchmark to get the same model.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "repository"
N_FEATURES = 30


def train():
    """(fitted model, X_test float32, y_test), deterministic."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.ensemble import GradientBoostingClassifier
    from sklearn.model_selection import train_test_split

    x, y = load_breast_cancer(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(x.astype("float32"), y, test_size=0.3, random_state=0)
    model = GradientBoostingClassifier(n_estimators=50, max_depth=3, random_state=0).fit(x_train, y_train)
    return model, x_test, y_test


def to_onnx(model) -> bytes:
    from skl2onnx import to_onnx as convert
    from skl2onnx.common.data_types import FloatTensorType

    onnx_model = convert(model, initial_types=[("input", FloatTensorType([None, N_FEATURES]))],
                         options={id(model): {"zipmap": False}}, target_opset=17)
    return onnx_model.SerializeToString()


def build(dest: Path | None = None) -> Path:
    dest = Path(dest) if dest is not None else TEMPLATE
    if dest.resolve() != TEMPLATE:
        shutil.copytree(TEMPLATE, dest, dirs_exist_ok=True)
    model, _, _ = train()
    version = dest / "breast_cancer" / "1"
    version.mkdir(parents=True, exist_ok=True)
    (version / "model.onnx").write_bytes(to_onnx(model))
    return dest


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
