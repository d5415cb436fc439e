"""Builds the voice-activity example repository from the silero-vad package:
the ONNX model as shipped, and its TorchScript twin wrapped so that the
recurrent state is an explicit input/output (nothing is downloaded).

    python examples/vad/build_repository.py [DEST]
"""
from __future__ import annotations

import shutil
import sys
import warnings
from pathlib import Path

TEMPLATE = Path(__file__).resolve().parent / "repository"


def _torchscript_step(path: Path) -> None:
    import torch

    data = Path(__import__("silero_vad").__file__).parent / "data"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packaged = torch.jit.load(str(data / "silero_vad.jit"), map_location="cpu")

        class SileroStep(torch.nn.Module):
            """One 16 kHz step: (context+chunk, state, sr) -> (speech prob, new state)."""

            def __init__(self, model):
                super().__init__()
                self.model = model

            def forward(self, input: torch.Tensor, state: torch.Tensor, sr: torch.Tensor):
                if int(sr) != 16000:
                    raise ValueError("this model takes 16000 Hz audio")
                return self.model(input, state)

        torch.jit.save(torch.jit.script(SileroStep(packaged._model)), str(path))


def build(dest: Path | None = None) -> Path:
    import silero_vad

    dest = Path(dest) if dest is not None else TEMPLATE
    if dest.resolve() != TEMPLATE:
        shutil.copytree(TEMPLATE, dest, dirs_exist_ok=True)
    data = Path(silero_vad.__file__).parent / "data"
    for model in ("silero_onnx", "silero_torch"):
        (dest / model / "1").mkdir(parents=True, exist_ok=True)
    shutil.copyfile(data / "silero_vad.onnx", dest / "silero_onnx" / "1" / "model.onnx")
    _torchscript_step(dest / "silero_torch" / "1" / "model.pt")
    return dest


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
