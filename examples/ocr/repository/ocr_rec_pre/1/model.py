"""Turns crops the classifier found upside down, then builds the recogniser's
batch (rapidocr's resize/normalise; one width for the whole image, so results
match rapidocr exactly when an image has at most rec_batch_num (6) lines).
Invariant: REC_INPUT has at least one row (the recogniser cannot run on 0)."""
import cv2
import numpy as np
from rapidocr_onnxruntime.ch_ppocr_rec import TextRecognizer
from rapidocr_onnxruntime.main import DEFAULT_CFG_PATH
from rapidocr_onnxruntime.utils import read_yaml


class RecPre:
    def load(self, context):
        config = read_yaml(DEFAULT_CFG_PATH)
        self.labels = config["Cls"]["label_list"]
        self.cls_thresh = config["Cls"]["cls_thresh"]
        self.rec = TextRecognizer.__new__(TextRecognizer)
        self.rec.rec_image_shape = config["Rec"]["rec_img_shape"]

    def execute(self, requests):
        return [self._one(r.inputs) for r in requests]

    def _one(self, inputs):
        crops = [c[:h, :w] for c, (h, w) in zip(inputs["CROPS"], inputs["CROP_SIZES"], strict=False)]
        for i, prob in enumerate(inputs["CLS_PROB"]):
            label = int(prob.argmax())
            if "180" in self.labels[label] and prob[label] > self.cls_thresh:
                crops[i] = cv2.rotate(crops[i], 1)
        _, img_h, img_w = self.rec.rec_image_shape
        ratio = max([img_w / img_h] + [c.shape[1] / c.shape[0] for c in crops])
        if not crops:
            return {"REC_INPUT": np.zeros((1, 3, img_h, int(img_h * ratio)), np.float32)}
        return {"REC_INPUT": np.stack([self.rec.resize_norm_img(c, ratio) for c in crops]).astype(np.float32)}
