"""Request parsing: OpenAI/vLLM JSON bodies -> validated engine `Request`s, with vLLM's 400s.

Unknown fields are ignored, as vLLM ignores sampling extras it does not need here.
"""
from __future__ import annotations

import orjson

from proxy.sim.config import SimConfig
from proxy.sim.engine import Request
from proxy.sim.errors import bad_request
from proxy.sim.models import Models
from proxy.sim.tokenizer import generate_words, natural_length, render_chat, tokenize

MM_REQUEST_FIELDS = ("mm_processor_kwargs", "multi_modal_data", "media_io_kwargs")
GOLDEN = 0x9E3779B97F4A7C15


def parse_json(raw: bytes) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"JSON decode error: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body


def _int(body: dict, key: str, default: int | None, minimum: int) -> int | None:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise bad_request(f"{key} must be an integer >= {minimum}, got {value!r}.", param=key)
    return value


def _check_multimodal(body: dict, has_media_parts: bool, config: SimConfig) -> bool:
    multimodal = has_media_parts or any(body.get(k) is not None for k in MM_REQUEST_FIELDS)
    if multimodal and not config.trust_request_mm_kwargs:
        raise bad_request("Multimodal inputs and per-request multimodal kwargs are disabled on this replica; "
                          "start it with --trust-request-mm-kwargs to accept them.")
    return multimodal


def _prompts(value: object, param: str) -> list[list[int]]:
    """A completion prompt / embedding input: str, [str], [int] or [[int]]."""
    if isinstance(value, str):
        prompts = [list(tokenize(value))]
    elif isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        prompts = [value]
    elif isinstance(value, list) and value and all(isinstance(p, str) for p in value):
        prompts = [list(tokenize(p)) for p in value]
    elif isinstance(value, list) and value and all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in value):
        prompts = value
    else:
        raise bad_request(f"'{param}' must be a string, a list of strings, a list of token ids or a list of "
                          "lists of token ids.", param=param)
    if any(not p for p in prompts):
        raise bad_request("The prompt cannot be empty.", param=param)
    return prompts


def _check_length(prompts: list[list[int]], max_tokens: int, config: SimConfig) -> None:
    limit = config.max_model_len
    for prompt in prompts:
        if len(prompt) >= limit:
            raise bad_request(f"This model's maximum context length is {limit} tokens. However, your request has "
                              f"{len(prompt)} input tokens. Please reduce the length of the input messages.")
        if len(prompt) + max_tokens > limit:
            raise bad_request(f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                              f"maximum context length is {limit} tokens and your request has {len(prompt)} input "
                              f"tokens ({max_tokens} > {limit} - {len(prompt)}).")


def _sampling(req: Request, body: dict, config: SimConfig) -> int:
    """n, streaming options and the deterministic text of every choice; returns max_tokens."""
    req.n = _int(body, "n", 1, 1)
    max_tokens = _int(body, "max_completion_tokens", None, 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", config.default_max_tokens, 1)
    _check_length(req.prompts, max_tokens, config)
    min_tokens = _int(body, "min_tokens", 0, 0)
    ignore_eos = bool(body.get("ignore_eos"))
    req.stream = bool(body.get("stream"))
    options = body.get("stream_options")
    req.include_usage = req.stream and isinstance(options, dict) and bool(options.get("include_usage"))
    for prompt in req.prompts:
        seed = hash(tuple(prompt)) ^ config.seed
        for j in range(req.n):
            choice_seed = seed + j * GOLDEN
            wanted = max_tokens if ignore_eos else max(natural_length(choice_seed), min_tokens)
            count = min(wanted, max_tokens)
            req.outputs.append(generate_words(choice_seed, count))
            req.finish.append("stop" if wanted < max_tokens else "length")
    return max_tokens


def parse_chat(body: dict, models: Models) -> Request:
    config = models.config
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty list.", param="messages")
    media = False
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad_request("Each message must be an object with a string 'role'.", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    raise bad_request("Each content part must be an object with a string 'type'.",
                                      param="messages")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise bad_request("A text content part needs a string 'text'.", param="messages")
                media = media or part["type"] != "text"
        elif content is not None and not isinstance(content, str):
            raise bad_request("Message content must be a string or a list of content parts.", param="messages")
    multimodal = _check_multimodal(body, media, config)
    adapter = models.resolve(body.get("model"))
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("'tools' must be a list.", param="tools")
    function = _forced_function(tools or [], body.get("tool_choice"))
    req = Request("chat", body.get("model") or models.base_id, adapter, [render_chat(messages, tools)],
                  multimodal=multimodal)
    max_tokens = _sampling(req, body, config)
    if function is not None:
        req.tool = function.get("name")
        _tool_outputs(req, function, max_tokens)
    return req


def _forced_function(tools: list, choice: object) -> dict | None:
    """The function the answer must call (tool_choice "required" or named), else None."""
    functions = [t.get("function") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]
    if choice == "required":
        if not functions:
            raise bad_request("tool_choice 'required' needs at least one tool in 'tools'.", param="tool_choice")
        return functions[0]
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if isinstance(choice.get("function"), dict) else None
        for function in functions:
            if function.get("name") == name:
                return function
        raise bad_request(f"Tool '{name}' has not been passed in `tools`.", param="tool_choice")
    return None


def _tool_outputs(req: Request, function: dict, max_tokens: int) -> None:
    """Replace the text of every choice with JSON arguments for `function`, 4 characters a token."""
    seed = hash(tuple(req.prompts[0]))  # ints hash the same in every process: replicas agree
    for i in range(len(req.outputs)):
        arguments = _arguments(function, seed + i)
        pieces = [arguments[k:k + 4] for k in range(0, len(arguments), 4)]
        req.outputs[i] = pieces[:max_tokens]
        req.finish[i] = "tool_calls" if len(pieces) <= max_tokens else "length"


def _arguments(function: dict, seed: int) -> str:
    params = function.get("parameters")
    props = params.get("properties") if isinstance(params, dict) else None
    values: dict[str, object] = {}
    for k, (key, spec) in enumerate((props or {}).items()):
        spec = spec if isinstance(spec, dict) else {}
        word = generate_words(seed + k, 1)[0]
        kind = spec.get("type")
        if isinstance(spec.get("enum"), list) and spec["enum"]:
            values[key] = spec["enum"][(seed + k) % len(spec["enum"])]
        elif kind == "integer":
            values[key] = (seed + k) % 100
        elif kind == "number":
            values[key] = ((seed + k) % 1000) / 10
        elif kind == "boolean":
            values[key] = bool((seed + k) % 2)
        elif kind == "array":
            values[key] = [word]
        elif kind == "object":
            values[key] = {}
        else:
            values[key] = word
    return orjson.dumps(values).decode()


def parse_completion(body: dict, models: Models) -> Request:
    config = models.config
    multimodal = _check_multimodal(body, False, config)
    adapter = models.resolve(body.get("model"))
    if "prompt" not in body:
        raise bad_request("'prompt' is required.", param="prompt")
    req = Request("completion", body.get("model") or models.base_id, adapter, _prompts(body["prompt"], "prompt"),
                  multimodal=multimodal)
    _sampling(req, body, config)
    return req


def parse_embedding(body: dict, models: Models) -> Request:
    adapter = models.resolve(body.get("model"))
    if "input" not in body:
        raise bad_request("'input' is required.", param="input")
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise bad_request("encoding_format must be 'float' or 'base64'.", param="encoding_format")
    prompts = _prompts(body["input"], "input")
    for prompt in prompts:
        if len(prompt) > models.config.max_model_len:
            raise bad_request(f"This model's maximum context length is {models.config.max_model_len} tokens. "
                              f"However, you requested {len(prompt)} tokens in the input for embedding generation. "
                              "Please reduce the length of the input.")
    return Request("embedding", body.get("model") or models.base_id, adapter, prompts,
                   options={"encoding_format": fmt})
