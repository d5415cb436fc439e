"""Builds the OCR example repository: copies the committed configs and
python steps to DEST (default: the repository/ folder beside this file) and
adds the PP-OCRv4 ONNX models and character list from the installed
rapidocr-onnxruntime package. Nothing is downloaded.

    python examples/ocr/build_repository.py [DEST]
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "repository"
MODELS = {
    "ocr_det": "ch_PP-OCRv4_det_infer.onnx",
    "ocr_cls": "ch_ppocr_mobile_v2.0_cls_infer.onnx",
    "ocr_rec": "ch_PP-OCRv4_rec_infer.onnx",
}


def build(dest: Path | None = None) -> Path:
    import onnxruntime as ort
    import rapidocr_onnxruntime

    dest = Path(dest) if dest is not None else TEMPLATE
    if dest.resolve() != TEMPLATE:
        shutil.copytree(TEMPLATE, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.onnx", "__pycache__"))
    source = Path(rapidocr_onnxruntime.__file__).parent / "models"
    for model, filename in MODELS.items():
        (dest / model / "1").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source / filename, dest / model / "1" / "model.onnx")
    session = ort.InferenceSession(str(source / MODELS["ocr_rec"]), providers=["CPUExecutionProvider"])
    keys = session.get_modelmeta().custom_metadata_map["character"]
    (dest / "ocr_rec_post" / "1" / "keys.txt").write_text(keys, encoding="utf-8")
    return dest


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
