"""The OCR example ensemble (examples/ocr) against the rapidocr package:
same texts, scores and boxes on rendered images, through a live server."""
import importlib.util
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("rapidocr_onnxruntime")
pytest.importorskip("cv2")
PIL = pytest.importorskip("PIL")
httpclient = pytest.importorskip("tritonclient.http")

from PIL import Image, ImageDraw, ImageFont  # noqa: E402

from tests.integration.kserve.live import ROOT, live_server  # noqa: E402

IMAGES = {
    "two_lines": (["Hello Kiln 2026", "model serving"], (640, 200)),
    "three_lines": (["OCR via ensembles", "KServe v2 protocol", "batch 42"], (700, 220)),
}


def render(lines, size):
    image = Image.new("RGB", size, "white")
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=32)
    for i, line in enumerate(lines):
        draw.text((20, 20 + i * 55), line, fill="black", font=font)
    return np.ascontiguousarray(np.array(image)[:, :, ::-1])  # BGR, as cv2 reads it


def _build_module():
    spec = importlib.util.spec_from_file_location("ocr_build", ROOT / "examples" / "ocr" / "build_repository.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ocr_server(tmp_path_factory):
    repo = _build_module().build(Path(tmp_path_factory.mktemp("ocr")) / "repo")
    with live_server(repo, timeout=180) as live:
        yield live


def _kiln_ocr(server, image):
    client = httpclient.InferenceServerClient(server.http_url, network_timeout=120)
    tensor = httpclient.InferInput("IMAGE", list(image.shape), "UINT8")
    tensor.set_data_from_numpy(image)
    result = client.infer("ocr", [tensor])
    texts = [t.decode("utf-8") for t in result.as_numpy("TEXTS")]
    return texts, result.as_numpy("SCORES"), result.as_numpy("BOXES")


@pytest.mark.parametrize("name", list(IMAGES))
def test_ensemble_matches_rapidocr(ocr_server, name):
    from rapidocr_onnxruntime import RapidOCR

    image = render(*IMAGES[name])
    reference, _ = RapidOCR()(image)
    texts, scores, boxes = _kiln_ocr(ocr_server, image)
    assert texts == [r[1] for r in reference]
    np.testing.assert_allclose(scores, [r[2] for r in reference], rtol=1e-5)
    np.testing.assert_allclose(boxes, np.array([r[0] for r in reference], np.float32), atol=1e-3)
    words = " ".join(texts).replace(" ", "").lower()
    assert "kserve" in words or "kiln" in words  # the text is really read


def test_blank_image_gives_no_text(ocr_server):
    texts, scores, boxes = _kiln_ocr(ocr_server, np.full((120, 300, 3), 255, np.uint8))
    assert texts == [] and scores.shape == (0,) and boxes.shape == (0, 4, 2)
