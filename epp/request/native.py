"""Engine-native token-in APIs, keyed like a completion prompt of token ids.

* SGLang ``POST /generate`` (``GenerateReqInput``): exactly one of ``text`` (a string or a
  batch of strings), ``input_ids`` (token ids, or a batch of lists) and ``input_embeds``
  (not keyed: routed by load). Media (``image_data``, ``audio_data``, ``video_data``) is keyed
  by digest before the prompt: the engine's cache diverges where the medium's tokens are, which
  the text alone does not say, so two requests share key only if they share media.
* vLLM ``POST /inference/v1/generate`` (token in, token out): ``token_ids`` (at least one),
  with the media items of ``features`` (``mm_hashes`` and ``mm_placeholders``) keyed at their
  placeholders' offsets, where vLLM's block hashes take them in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from epp.errors import BadRequest
from epp.request.flatten import completion_prompt, media_digest, media_key, token_ids_text

_SGLANG_PROMPTS = ("text", "input_ids", "input_embeds")
_SGLANG_MEDIA = ("image_data", "audio_data", "video_data")


def sglang_generate_prompt(doc: Mapping[str, Any]) -> str:
    given = [name for name in _SGLANG_PROMPTS if doc.get(name) is not None]
    if len(given) != 1:
        raise BadRequest("exactly one of 'text', 'input_ids' or 'input_embeds' is required")
    field = given[0]
    if field == "input_embeds":
        return ""
    head = "".join(_media_keys(doc.get(name), name) for name in _SGLANG_MEDIA)
    return head + completion_prompt(doc[field], field)


def _media_keys(value: Any, field: str) -> str:
    """Keys of a media field: a reference, or lists (per prompt of a batch) of them."""
    if value is None:
        return ""
    if isinstance(value, list):
        return "".join(_media_keys(v, field) for v in value)
    digest = media_digest(value)
    if digest is None:
        raise BadRequest(f"'{field}' must hold media references (URLs, paths or base64 data)")
    return media_key(field, digest)


def vllm_generate_prompt(doc: Mapping[str, Any]) -> str:
    ids = doc.get("token_ids")
    if not isinstance(ids, list) or not ids:
        raise BadRequest("'token_ids' must be a non-empty list of token ids")
    features = doc.get("features")
    if features is None:
        return token_ids_text(ids, "token_ids")
    items = _placeholders(features, len(ids))
    out = []
    start = 0
    for offset, kind, digest in items:
        out.append(token_ids_text(ids[start:offset], "token_ids") if offset > start else "")
        out.append(media_key(kind, digest))
        start = offset
    out.append(token_ids_text(ids[start:], "token_ids"))
    return "".join(out)


def _placeholders(features: Any, n_ids: int) -> list[tuple[int, str, str]]:
    """``(offset, modality, digest)`` of each media item, by offset."""
    if not isinstance(features, Mapping):
        raise BadRequest("'features' must be an object")
    hashes = features.get("mm_hashes")
    places = features.get("mm_placeholders")
    if not isinstance(hashes, Mapping) or not isinstance(places, Mapping):
        raise BadRequest("'features' must hold 'mm_hashes' and 'mm_placeholders' objects")
    items = []
    for kind, ranges in places.items():
        ids = hashes.get(kind)
        where = f"features.mm_placeholders.{kind}"
        if not isinstance(ranges, list) or not isinstance(ids, list) or len(ids) != len(ranges):
            raise BadRequest(f"'{where}' must be a list with one entry per 'mm_hashes.{kind}'")
        for r, h in zip(ranges, ids, strict=True):
            offset = r.get("offset") if isinstance(r, Mapping) else None
            if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset <= n_ids:
                raise BadRequest(f"'{where}[].offset' must be an integer within 'token_ids'")
            if not isinstance(h, str):
                raise BadRequest(f"'features.mm_hashes.{kind}' must be a list of strings")
            items.append((offset, str(kind), media_digest(h) or ""))
    items.sort()
    return items
