"""Names shared across process boundaries, defined once: Triton models, their tensors, backend roles.

The ``llm`` ensemble keeps TensorRT-LLM's ensemble names (``text_input``, ``max_tokens``,
``stream``, ... -> ``text_output``) so that existing clients and benchmark tools work unchanged.
Each tensor's type and dims, per model, are ``serving/wire.py``'s; ``model_repo/*/config.pbtxt``
declares the same (a test checks that they agree).
"""

from __future__ import annotations

import enum

OVERLOADED = "overloaded: "  # starts every error a node answers to shed load (the request may succeed elsewhere)


class Model(enum.StrEnum):
    """Models of the repository (``model_repo/``)."""

    LLM = "llm"  # the client-facing ensemble: preprocessing -> decode (which answers text_output too)
    PREPROCESSING = "preprocessing"
    DECODE = "decode"
    PREFILL = "prefill"  # prefill nodes
    ENSEMBLE = "ensemble"  # TensorRT-LLM's ensemble name and shapes (a batch dimension) over `llm`


class BackendRole(enum.StrEnum):
    """The ``role`` parameter of a ``disagg_backend`` model: which class of the backend serves it."""

    PREPROCESSING = "preprocessing"
    DECODE = "decode"
    PREFILL = "prefill"
    BATCH_ADAPTER = "batch_adapter"


class Tensor(enum.StrEnum):
    """Input and output tensor names."""

    # llm / preprocessing
    TEXT_INPUT = "text_input"
    CHAT = "chat"
    EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"
    INPUT_IDS = "input_ids"
    # decode
    MAX_TOKENS = "max_tokens"
    STREAM = "stream"
    TEMPERATURE = "temperature"
    TOP_K = "top_k"
    TOP_P = "top_p"
    RANDOM_SEED = "random_seed"
    STOP_WORDS = "stop_words"
    END_ID = "end_id"
    BEAM_WIDTH = "beam_width"
    IGNORE_EOS = "ignore_eos"
    SPECULATE = "speculate"  # ours: per-request speculative decoding on / off (unset: the deployment's default)
    CACHE_SALT = "cache_salt"  # ours (vLLM's name): only requests with the same salt share cached KV pages
    GUIDE_TYPE = "guided_decoding_guide_type"  # TensorRT-LLM's: json, json_schema, regex, ebnf_grammar (+ lark_grammar)
    GUIDE = "guided_decoding_guide"  # TensorRT-LLM's: the schema / regex / grammar text
    REPETITION_PENALTY = "repetition_penalty"
    PRESENCE_PENALTY = "presence_penalty"
    FREQUENCY_PENALTY = "frequency_penalty"
    RETURN_LOG_PROBS = "return_log_probs"
    TOP_LOGPROBS = "top_logprobs"  # ours: alternatives per token with return_log_probs (0..20)
    MIN_TOKENS = "min_tokens"  # ours (vLLM's name): EOS and stop ids are not sampled before this many tokens
    STOP_TOKEN_IDS = "stop_token_ids"  # ours (vLLM's name): more ids than end_id's one that end the output
    LOGIT_BIAS_IDS = "logit_bias_ids"  # ours: OpenAI's logit_bias as parallel arrays (ids, values in [-100, 100])
    LOGIT_BIAS_VALUES = "logit_bias_values"
    PROMPT_LOGPROBS = "prompt_logprobs"  # ours (vLLM's name): each prompt token's log-probability + this many top
    NUM_RETURN_SEQUENCES = "num_return_sequences"
    STOP = "stop"  # TensorRT-LLM's: true stops the live requests named by this call's request id
    KV_EVENTS_QUERY = "kv_events_query"  # ours: a KVEventsQuery (JSON): answered with kv_events, nothing generated
    KV_EVENTS = "kv_events"  # ours: a KVEventBatch (JSON): the node's prefix-cache events (serving/kv_events.py)
    PAD_ID = "pad_id"  # accepted on `ensemble` (TensorRT-LLM clients send it), not used
    OUTPUT_IDS = "output_ids"
    SEQUENCE_LENGTH = "sequence_length"  # tokens generated so far
    CACHED_TOKENS = "cached_tokens"  # ours: prompt tokens whose KV came from the prefix cache
    FINISH_REASON = "finish_reason"  # ours: "" until the last response, then "stop" or "length"
    OUTPUT_LOG_PROBS = "output_log_probs"  # of the response's new tokens
    CUM_LOG_PROBS = "cum_log_probs"  # `ensemble`: of every token so far
    TOP_LOGPROB_IDS = "top_logprob_ids"  # [new tokens, top_logprobs]
    TOP_LOGPROB_VALUES = "top_logprob_values"
    PROMPT_LOG_PROBS = "prompt_log_probs"  # ours: of prompt tokens 1.. (token 0 has none), on the first response
    PROMPT_TOP_IDS = "prompt_top_logprob_ids"  # [prompt tokens - 1, prompt_logprobs]
    PROMPT_TOP_VALUES = "prompt_top_logprob_values"
    TEXT_SKIP = "text_skip"
    # postprocessing / llm
    TEXT_OUTPUT = "text_output"
    # prefill
    HANDSHAKE = "handshake"
    ENDPOINT = "endpoint"
    PREFILL_REQUEST = "prefill_request"
    LOAD_TOKENS = "load_tokens"
