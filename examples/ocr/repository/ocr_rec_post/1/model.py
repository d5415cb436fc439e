"""CTC decoding (rapidocr's CTCLabelDecode, with the character list the
recogniser ships in its metadata) and rapidocr's text_score filter."""
from pathlib import Path

import numpy as np
from rapidocr_onnxruntime.ch_ppocr_rec.utils import CTCLabelDecode


class RecPost:
    def load(self, context):
        keys = Path(context.version_dir, "keys.txt").read_text(encoding="utf-8").splitlines()
        self.decode = CTCLabelDecode(character=keys)
        self.text_score = float(context.config.parameters.get("text_score", 0.5))

    def execute(self, requests):
        return [self._one(r.inputs) for r in requests]

    def _one(self, inputs):
        boxes = inputs["BOXES"]
        results = self.decode(inputs["REC_PROB"])[: len(boxes)]
        keep = [i for i, (_, score) in enumerate(results) if float(score) >= self.text_score]
        texts = np.empty(len(keep), dtype=object)
        texts[:] = [results[i][0].encode("utf-8") for i in keep]
        return {
            "TEXTS": texts,
            "SCORES": np.array([results[i][1] for i in keep], np.float32),
            "BOXES": boxes[keep].reshape(-1, 4, 2),
        }
