"""Detection pre-processing, exactly as rapidocr-onnxruntime does it:
resize limits, round letterbox for flat images, DB resize and normalisation."""
import numpy as np
from rapidocr_onnxruntime.ch_ppocr_det.utils import DetPreProcess
from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH, RapidOCR
from rapidocr_onnxruntime.utils import read_yaml


class DetPre:
    def load(self, context):
        config = read_yaml(DEFAULT_CFG_PATH)
        glob, det = config["Global"], config["Det"]
        # RapidOCR's own methods on a bare object: same code, no sessions loaded.
        self.ocr = RapidOCR.__new__(RapidOCR)
        self.ocr.max_side_len, self.ocr.min_side_len = glob["max_side_len"], glob["min_side_len"]
        self.ocr.min_height, self.ocr.width_height_ratio = glob["min_height"], glob["width_height_ratio"]
        self.det = DetPreProcess(det["limit_side_len"], det["limit_type"], det["mean"], det["std"])

    def execute(self, requests):
        return [self._one(r.inputs["IMAGE"]) for r in requests]

    def _one(self, image):
        raw_h, raw_w = image.shape[:2]
        img, ratio_h, ratio_w = self.ocr.preprocess(np.ascontiguousarray(image))
        img, record = self.ocr.maybe_add_letterbox(img, {})
        meta = np.array([ratio_h, ratio_w, record["padding_1"]["top"], raw_h, raw_w], np.float32)
        return {"DET_INPUT": self.det(img), "PREPARED": img, "DET_META": meta}
