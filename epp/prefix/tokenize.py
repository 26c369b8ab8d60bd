"""The model's tokenizer and chat template, applied to a request the way vLLM applies them,
so that the precise producer hashes the token ids the server will see.

A model's tokenizer is a Hugging Face directory (``tokenizer.json``, and
``tokenizer_config.json`` with the ``chat_template`` and special tokens, or a
``chat_template.jinja`` file). Where vLLM's OpenAI server is the reference:

* ``/v1/completions``: a string prompt is encoded with the tokenizer's special tokens
  (``add_special_tokens``, default true, e.g. a BOS), a token-id prompt is taken as is; a
  batch of several prompts is several requests to vLLM and is not keyed here.
* ``/v1/chat/completions``: the chat template is rendered (``add_generation_prompt`` and
  ``continue_final_message`` as the request sets them, ``tools``, ``documents``,
  ``chat_template_kwargs``), with text-part lists joined by newlines (vLLM's "string"
  content format), then encoded without special tokens (the template writes them).

What cannot be reproduced (a request carrying its own ``chat_template``, images or audio,
the Responses API) returns ``None``: the approximate index scores that request.
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_MAX_TEMPLATE_CHARS = 1 << 20


class TokenizerError(ValueError):
    """A tokenizer directory that cannot be used (named in the message)."""


def _special(value: Any) -> str:
    if isinstance(value, Mapping):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def _raise(message: str) -> None:
    raise ValueError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)  # fmt: skip


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ModelTokenizer:
    """One model's tokenizer and chat template."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{directory}: no tokenizer.json")
        try:  # the precise extra (pip install 'epp[precise]'): imported only when used
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(
                "the precise prefix producer needs the tokenizers and Jinja2 packages: "
                "pip install 'epp[precise]'"
            ) from None
        try:
            self.tokenizer = Tokenizer.from_file(str(tok_file))
        except Exception as exc:  # the tokenizers library raises its own Exception type
            raise TokenizerError(f"{tok_file}: {exc}") from None
        # ids without offsets where the installed tokenizers has it: 15-40% less CPU on long
        # prompts; like encode_batch, it releases the GIL
        self._batch: Callable[..., list[Any]] = getattr(
            self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch
        )
        config: Mapping[str, Any] = {}
        cfg_file = directory / "tokenizer_config.json"
        if cfg_file.is_file():
            try:
                loaded = json.loads(cfg_file.read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise TokenizerError(f"{cfg_file}: {exc}") from None
            if isinstance(loaded, Mapping):
                config = loaded
        self.bos_token = _special(config.get("bos_token"))
        self.eos_token = _special(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", False))
        self.bos_id = self.tokenizer.token_to_id(self.bos_token) if self.bos_token else None
        template = config.get("chat_template")
        jinja_file = directory / "chat_template.jinja"
        if jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates: the "default" one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default")
        self._template: Any = None
        if isinstance(template, str) and len(template) <= _MAX_TEMPLATE_CHARS:
            from jinja2 import ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=[ext.loopcontrols]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = _strftime_now
            try:
                self._template = env.from_string(template)
            except Exception as exc:  # jinja2's TemplateSyntaxError and friends
                raise TokenizerError(f"{directory}: chat template does not compile: {exc}") from None
        self._cuts = self._cut_pattern(template if isinstance(template, str) else "")
        self._special_prefix_only = self._specials_only_prepend()

    # --- segments: where a rendered prompt can be tokenized piece by piece ---------------

    def _cut_pattern(self, template: str) -> re.Pattern[str] | None:
        """The special tokens a rendered prompt may be cut before, as one pattern, or None.

        The tokenizer splits its input at added tokens before normalizing and
        pre-tokenizing it, so the text between two of them is tokenized on its own: a prompt
        cut just before one encodes, piece by piece, to the same ids as whole. That holds
        for a token matched verbatim (not ``normalized``, ``lstrip`` or ``single_word``),
        and not for a pre-tokenizer that marks only the input's first word (Metaspace's
        ``prepend_scheme: first``); a probe checks it. The cuts are the special tokens the
        chat template writes, and BOS/EOS."""
        try:
            spec = json.loads(self.tokenizer.to_str())
        except ValueError:
            return None
        if "first" in json.dumps(spec.get("pre_tokenizer")):  # Metaspace prepend_scheme=first
            return None
        names = {self.bos_token, self.eos_token} - {""}
        for added in spec.get("added_tokens") or ():
            content = added.get("content", "")
            if added.get("lstrip") or added.get("single_word") or not content:
                names.discard(content)
                continue
            if content in template:
                names.add(content)
        if not names:
            return None
        pattern = re.compile("|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)))
        for name in names:  # the probe: whole and piecewise must agree
            probe = f"Hi there,\n  {name} 12 words\n\n{name}{name}next  line {name}"
            whole = self.tokenizer.encode(probe, add_special_tokens=False).ids
            cuts = [m.start() for m in pattern.finditer(probe)]
            pieces = [probe[a:b] for a, b in zip([0, *cuts], [*cuts, len(probe)], strict=True) if b > a]
            split = [i for e in self._batch(pieces, add_special_tokens=False)
                     for i in e.ids]  # fmt: skip
            if split != whole:
                log.info("precise prefix: %s cannot be tokenized piecewise at %r: the token "
                         "cache reuses whole prompts only", self.directory, name)  # fmt: skip
                return None
        return pattern

    def _specials_only_prepend(self) -> bool:
        """The post-processor's special tokens (with ``add_special_tokens``) all come before
        the text, so only a prompt's first piece carries them."""
        plain = self.encode("hello", False)
        full = self.encode("hello", True)
        return full[len(full) - len(plain) :] == plain

    def segments(self, text: str, add_special_tokens: bool) -> list[str]:
        """``text`` cut before each of the special tokens it can be cut at (one piece when
        there are none): the pieces encode, the first with ``add_special_tokens`` and the
        others without, to the ids of the whole."""
        cuts = self._cuts
        if cuts is None or (add_special_tokens and not self._special_prefix_only):
            return [text]
        starts = [m.start() for m in cuts.finditer(text)]
        if not starts:
            return [text]
        bounds = [0, *starts, len(text)]
        return [text[a:b] for a, b in itertools.pairwise(bounds) if b > a]

    def disable_segments(self) -> None:
        """Tokenize prompts whole from now on (a piecewise encoding disagreed)."""
        self._cuts = None

    def encode_pieces(self, pieces: Sequence[str], first: bool, add_special_tokens: bool) -> list[list[int]]:
        """The ids of each piece: ``first`` says the first piece starts the prompt (it takes
        the special tokens when asked for)."""
        if not pieces:
            return []
        out: list[list[int]] = []
        rest = pieces
        if first:
            out.append(self.encode(pieces[0], add_special_tokens))
            rest = pieces[1:]
        if rest:
            out.extend(e.ids for e in self._batch(list(rest), add_special_tokens=False))
        return out

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        # the batch call releases the GIL (encode does not): a long prompt tokenized in a
        # worker thread leaves the event loop running
        ids: list[int] = self._batch(
            [text], add_special_tokens=add_special_tokens
        )[0].ids
        bos = self.bos_id
        if add_special_tokens and self.add_bos and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids

    def render_chat(self, body: Mapping[str, Any]) -> str | None:
        """The chat template's text for ``body``, or None when it cannot be reproduced."""
        if self._template is None or "chat_template" in body:
            return None
        messages = body.get("messages")
        if not isinstance(messages, list):
            return None
        rendered: list[dict[str, Any]] = []
        for m in messages:
            if not isinstance(m, Mapping):
                return None
            content = m.get("content")
            if isinstance(content, list):
                texts = []
                for part in content:
                    if not isinstance(part, Mapping) or part.get("type") != "text":
                        return None  # images, audio: multimodal keys are not reproduced
                    texts.append(str(part.get("text", "")))
                content = "\n".join(texts)
            rendered.append({**m, "content": content})
        continue_final = body.get("continue_final_message") is True
        kwargs = body.get("chat_template_kwargs")
        extra = dict(kwargs) if isinstance(kwargs, Mapping) else {}
        gen = body.get("add_generation_prompt", True) is not False and not continue_final
        try:
            text: str = self._template.render(
                **extra, messages=rendered, add_generation_prompt=gen,
                tools=body.get("tools"), documents=body.get("documents"),
                bos_token=self.bos_token, eos_token=self.eos_token,
            )  # fmt: skip
        except Exception:  # a template's raise_exception, or a message it rejects
            return None
        if continue_final and rendered:
            last = rendered[-1].get("content")
            if isinstance(last, str) and last:
                cut = text.rfind(last.strip())
                if cut >= 0:
                    text = text[: cut + len(last.strip())]
        return text

    def prompt_text(self, api_value: str, body: Mapping[str, Any]) -> tuple[str, bool] | list[int] | None:
        """What the server tokenizes for a request body of API ``api_value``: the text and
        whether it takes the special tokens, or the token ids a completion prompt gives,
        or None when it cannot be reproduced."""
        if api_value == "chat_completions":
            text = self.render_chat(body)
            if text is None:
                return None
            return text, body.get("add_special_tokens", False) is True
        if api_value != "completions":
            return None
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt, body.get("add_special_tokens", True) is not False
        if isinstance(prompt, list) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            return list(prompt)
        return None

    def ids(self, api_value: str, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids for a request body of API ``api_value``, or None."""
        prompt = self.prompt_text(api_value, body)
        if prompt is None or isinstance(prompt, list):
            return prompt
        return self.encode(*prompt)

    def completion_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        return self.ids("completions", body)

    def chat_ids(self, body: Mapping[str, Any]) -> list[int] | None:
        return self.ids("chat_completions", body)


class TokenizerPool:
    """Tokenizers by model name: an explicit ``model -> directory`` map first, then
    ``<root>/<model>`` (a mounted directory of models; ``/`` in a model name is a
    subdirectory), then ``root`` itself when it holds a ``tokenizer.json`` (one model).
    A directory that fails to load is logged once and the model is left to the
    approximate index."""

    def __init__(self, paths: Mapping[str, str], root: str = "") -> None:
        self.paths = dict(paths)
        self.root = Path(root) if root else None
        self._loaded: dict[str, ModelTokenizer | None] = {}

    def check(self) -> None:
        """Load every explicitly named tokenizer now (start-up: a bad path fails loudly), and
        fail at once when the libraries of the precise extra are not installed."""
        import importlib.util

        if any(importlib.util.find_spec(m) is None for m in ("tokenizers", "jinja2")):
            raise TokenizerError("the precise prefix producer needs the tokenizers and Jinja2 "
                                 "packages: pip install 'epp[precise]'")  # fmt: skip
        for model, path in self.paths.items():
            self._loaded[model] = ModelTokenizer(Path(path))

    def get(self, model: str) -> ModelTokenizer | None:
        try:
            return self._loaded[model]
        except KeyError:
            pass
        tok: ModelTokenizer | None = None
        directory = self._directory(model)
        if directory is not None:
            try:
                tok = ModelTokenizer(directory)
            except TokenizerError as exc:
                log.warning("precise prefix: no tokenizer for model %r: %s", model, exc)
        if len(self._loaded) < 1024:  # model names come from clients: bound the cache
            self._loaded[model] = tok
        return tok

    def named(self, model: str) -> bool:
        """The model has a tokenizer of its own (a ``tokenizers`` entry or ``<root>/<model>``),
        not just the root's single one."""
        directory = self._directory(model)
        return directory is not None and directory != self.root

    def _directory(self, model: str) -> Path | None:
        if model in self.paths:
            return Path(self.paths[model])
        if self.root is None:
            return None
        candidate = self.root / model
        name = Path(model)
        if not name.is_absolute() and ".." not in name.parts and (candidate / "tokenizer.json").is_file():
            return candidate
        if (self.root / "tokenizer.json").is_file():
            return self.root
        return None


def token_ids(tok: ModelTokenizer, api_value: str, body: Mapping[str, Any]) -> Sequence[int] | None:
    """The prompt's token ids for a request body of API ``api_value``, or None."""
    return tok.ids(api_value, body)
