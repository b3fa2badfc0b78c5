"""TensorRT-LLM's ensemble shapes on top of ours. No Triton import.

TensorRT-LLM's ensemble (model ``ensemble``, what its clients call by default) batches: every
input carries a leading batch dimension (``text_input`` ``[1, 1]``, ``stop_words`` ``[1, n]``).
Triton checks each input's rank against the model config, so one model cannot take both that
and our ``llm``'s ``[1]``. The ``ensemble`` model therefore strips the batch dimension (batch
size 1: one request per call, as TensorRT-LLM's clients send them), runs the request through
``llm``, and puts the dimension back on the outputs as TensorRT-LLM's postprocessing shapes them.
"""

from __future__ import annotations

import numpy as np

from serving.names import Tensor
from torch_engine.sampling import InvalidRequestError

# TensorRT-LLM inputs we accept and do not need (pad_id: nothing is padded here)
IGNORED = frozenset({Tensor.PAD_ID})


def unbatch(name: str, value: np.ndarray) -> np.ndarray:
    """One input without its batch dimension; a batch other than 1 is refused by name."""
    if value.ndim < 1 or value.shape[0] != 1:
        raise InvalidRequestError(
            f"input {name} has shape {list(value.shape)}: the ensemble takes one request per call "
            "(a leading batch dimension of 1, e.g. [1, 1])"
        )
    return value[0]


def text_output(piece: np.ndarray) -> np.ndarray:
    """``text_output`` as TensorRT-LLM's postprocessing sends it: one string per batch row (``[1]``)."""
    return np.array([b"".join(piece.reshape(-1))], dtype=np.object_)


def log_prob_outputs(logprobs: np.ndarray, cumulative: float) -> tuple[np.ndarray, np.ndarray]:
    """``output_log_probs`` ``[1, n]`` (this response's tokens) and ``cum_log_probs`` ``[1, 1]`` (all so far)."""
    return logprobs.astype(np.float32).reshape(1, -1), np.array([[cumulative]], dtype=np.float32)
