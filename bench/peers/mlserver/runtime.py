"""A minimal MLServer runtime serving one ONNX file with onnxruntime.

MLServer has no onnx runtime package on the registry, so the side-by-side
benchmark (run_bench.sh) uses this one, with the session options of Kiln's
tabular example (1 intra-op thread). Inputs/outputs keep the ONNX names.
"""
import numpy as np
import onnxruntime as ort
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class OnnxRuntime(MLModel):
    async def load(self) -> bool:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 1
        path = self.settings.parameters.uri
        self._session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        feeds = {i.name: NumpyCodec.decode_input(i) for i in payload.inputs}
        results = self._session.run(self._outputs, feeds)
        return InferenceResponse(
            model_name=self.name,
            outputs=[NumpyCodec.encode_output(n, np.asarray(r)) for n, r in zip(self._outputs, results, strict=False)],
        )
