"""DB post-processing to boxes, crops of each box, and the direction
classifier's input; all with rapidocr-onnxruntime's own functions."""
import numpy as np
from rapidocr_onnxruntime.ch_ppocr_cls import TextClassifier
from rapidocr_onnxruntime.ch_ppocr_det import TextDetector
from rapidocr_onnxruntime.ch_ppocr_det.utils import DBPostProcess
from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH, RapidOCR
from rapidocr_onnxruntime.utils import read_yaml


class DetPost:
    def load(self, context):
        config = read_yaml(DEFAULT_CFG_PATH)
        det = config["Det"]
        self.post = DBPostProcess(det["thresh"], det["box_thresh"], det["max_candidates"],
                                  det["unclip_ratio"], det["score_mode"], det["use_dilation"])
        self.detector = TextDetector.__new__(TextDetector)
        self.ocr = RapidOCR.__new__(RapidOCR)
        self.cls = TextClassifier.__new__(TextClassifier)
        self.cls.cls_image_shape = config["Cls"]["cls_image_shape"]

    def execute(self, requests):
        return [self._one(r.inputs) for r in requests]

    def _one(self, inputs):
        image, meta = inputs["PREPARED"], inputs["DET_META"]
        boxes, _ = self.post(inputs["DET_MAP"], image.shape[:2])
        boxes = self.detector.filter_tag_det_res(boxes, image.shape[:2])
        if len(boxes) == 0:
            return _empty()
        boxes = self.ocr.sorted_boxes(boxes)
        crops = self.ocr.get_crop_img_list(image, boxes)
        record = {"preprocess": {"ratio_h": float(meta[0]), "ratio_w": float(meta[1])},
                  "padding_1": {"top": int(meta[2]), "left": 0}}
        original = self.ocr._get_origin_points(boxes, record, int(meta[3]), int(meta[4]))
        return {
            "BOXES": original.astype(np.float32),
            "CROPS": _pad(crops),
            "CROP_SIZES": np.array([c.shape[:2] for c in crops], np.int32),
            "CLS_INPUT": np.stack([self.cls.resize_norm_img(c) for c in crops]).astype(np.float32),
        }


def _pad(crops):
    height = max(c.shape[0] for c in crops)
    width = max(c.shape[1] for c in crops)
    out = np.zeros((len(crops), height, width, 3), np.uint8)
    for i, crop in enumerate(crops):
        out[i, :crop.shape[0], :crop.shape[1]] = crop
    return out


def _empty():
    return {"BOXES": np.zeros((0, 4, 2), np.float32), "CROPS": np.zeros((0, 1, 1, 3), np.uint8),
            "CROP_SIZES": np.zeros((0, 2), np.int32), "CLS_INPUT": np.zeros((0, 3, 48, 192), np.float32)}
