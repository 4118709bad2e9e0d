"""A model folder's own Jinja chat template, rendered as transformers renders it, with the spans mmpack needs.

Why the real template and not parameters read off it: the template is code (Qwen3's adds an empty think block
to the last assistant turn only, Qwen2-VL's inserts "You are a helpful assistant." where a conversation has no
system turn, others number their images), so only running it gives `apply_chat_template`'s text for every
sample. Each conversation is rendered once, in the environment transformers uses (sandboxed, `trim_blocks`,
`lstrip_blocks`, `loopcontrols`, `tojson`, `raise_exception`, `strftime_now`; `{% generation %}` blocks
render their body), with the folder's special tokens (`bos_token`, `eos_token`, ...) as variables. The text is
then read, not rebuilt: what the template writes for each role before a message's content (its header) is
learnt once from probe conversations, and in every rendered sample each message is found by its header and
its content, in order. A message's turn runs to the next message's header (or the end); an assistant turn is
trained from its header's end to its turn's end less trailing whitespace (content and end-of-turn token, as
the model writes them after the generation prompt); media are the image / video pads the template wrote, one
per `<image>` / `<video>`. A sample the template renders in a way this cannot follow (a header or a
content piece not where it must be, another number of pads) raises `ChatTemplateError`.

Messages go to the template as transformers users write them: a plain string, or, where the message holds
media, a list of `{"type": "text" | "image" | "video"}` parts (Qwen2-VL-style templates write the vision
placeholder for each part). A template that cannot take parts (a text model's) gets the string with mmpack's
Qwen placeholder `<|vision_start|><|image_pad|><|vision_end|>` in place of each tag instead.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from mmpack.packing.errors import MmpackError
from mmpack.packing.template_limits import ChatTemplateLimitError, TemplateLimits
from mmpack.packing.tokenizer import SPECIAL_TOKENS, VIDEO_PAD

IMAGE_TAG = "<image>"
VIDEO_TAG = "<video>"
MEDIA_TAG_RE = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")
PADS = {IMAGE_TAG: SPECIAL_TOKENS["image_pad"], VIDEO_TAG: VIDEO_PAD}
# What a template may write for an image / a video part, the first form the default: Qwen-VL's vision block, or
# one media token that the processor expands (Gemma 4's `<|image|>` / `<|video|>`).
MEDIA_FORMS: dict[str, tuple[str, ...]] = {
    tag: (SPECIAL_TOKENS["vision_start"] + pad + SPECIAL_TOKENS["vision_end"], form)
    for (tag, pad), form in zip(PADS.items(), ("<|image|>", "<|video|>"))
}
# The files a model folder may hold its template in, in the order transformers prefers them.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")
TOKENIZER_CONFIG = "tokenizer_config.json"
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")
_MAX_JSON_BYTES = 64 << 20  # a tokenizer_config.json may carry many added tokens
LIMIT_ADVICE = (
    "a model folder's template renders under limits (docs/packing.md, chat templates): fix the template, or "
    "pass --chat-template builtin or another .jinja file"
)
# Probe texts: private-use characters no template adds and no real record is likely to hold.
_PROBES = ("\ue000mmpack-a\ue001", "\ue000mmpack-b\ue001", "\ue000mmpack-c\ue001")


class ChatTemplateError(MmpackError, ValueError):
    """A chat template mmpack cannot follow, or a sample it renders in a way mmpack cannot read."""


@dataclass
class RenderedChat:
    """A rendered conversation: the text to encode and what the loss mask, turn boundaries and media need."""

    text: str
    target_spans: list[tuple[int, int]] = field(default_factory=list)  # character spans carrying loss
    message_ends: list[int] = field(default_factory=list)  # character index past each message's turn
    media_char_spans: list[tuple[str, int, int]] = field(default_factory=list)  # (tag, start, end) in order


def read_folder_template(folder: str | Path) -> tuple[str, str, dict[str, str]] | None:
    """(template source, file it came from, special-token variables) of a model folder, or None if it has none.

    `chat_template.jinja` wins over a processor's `chat_template.json`, which wins over `tokenizer_config.json`'s
    `chat_template` (a string, or a list of named templates: the one named "default"). The variables are the
    `bos_token`, `eos_token`, `pad_token`, `unk_token` of `tokenizer_config.json`, as transformers passes them.
    """
    root = Path(folder)
    variables = _special_token_variables(root / TOKENIZER_CONFIG)
    for name in TEMPLATE_FILES:
        path = root / name
        if not path.is_file():
            continue
        if name.endswith(".jinja"):
            return _read_limited(path, 4 * TemplateLimits().max_source_chars), str(path), variables
        source = _template_of_json(path)
        if source is not None:
            return source, str(path), variables
    return None


def _template_of_json(path: Path) -> str | None:
    try:
        value = json.loads(_read_limited(path, _MAX_JSON_BYTES)).get("chat_template")
    except (ValueError, AttributeError) as exc:
        raise ChatTemplateError(f"{path}: not a JSON object ({exc}); fix or remove the file") from None
    if isinstance(value, list):  # [{"name": ..., "template": ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is not None and not isinstance(value, str):
        raise ChatTemplateError(f"{path}: chat_template must be a string or a list of named templates")
    return value


def _special_token_variables(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    try:
        config = json.loads(_read_limited(path, _MAX_JSON_BYTES))
    except ValueError as exc:
        raise ChatTemplateError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ChatTemplateError(
            f"{path}: not a JSON object (a {type(config).__name__}); fix or remove the file"
        )
    out = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = config.get(key)
        if isinstance(value, dict):  # {"content": "<|im_end|>", ...}
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def _read_limited(path: Path, max_bytes: int) -> str:
    """The UTF-8 text of a model folder's file, refused above `max_bytes` (a folder is input: it is bounded)."""
    size = path.stat().st_size
    if size > max_bytes:
        raise ChatTemplateLimitError(f"{path}: {size} bytes, above the limit of {max_bytes} for this file")
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(
            f"{path}: not UTF-8 text (byte {exc.start}: {exc.reason}); fix the file"
        ) from None


def _compile(source: str, limits: TemplateLimits, origin: str) -> Any:
    """The template in transformers' chat-template environment, under `limits` (`packing.template_limits`)."""
    import jinja2
    import jinja2.ext

    from mmpack.packing.bounded_jinja import BoundedEnvironment

    class _Generation(jinja2.ext.Extension):  # `{% generation %}...{% endgeneration %}`: render the body
        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it an instance variable)

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return str(caller())

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = BoundedEnvironment(
        limits, trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.compile_bounded(source)
    except ChatTemplateLimitError as exc:
        raise ChatTemplateLimitError(f"{origin}: the chat template {exc.message}; {LIMIT_ADVICE}") from None
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"the chat template does not compile: line {exc.lineno}: {_one_line(exc.message)}"
        ) from None
    except (jinja2.exceptions.TemplateError, SyntaxError, RecursionError, MemoryError, ValueError) as exc:
        # SyntaxError: Python's own (blocks nested too deep); RecursionError: expressions nested too deep
        raise ChatTemplateError(f"the chat template does not compile: {_describe(exc)}") from None


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _describe(exc: BaseException) -> str:
    return _one_line(f"{type(exc).__name__}: {exc}")


def _pieces(content: str) -> list[str]:
    """`content` split at its media tags (tags at odd positions)."""
    return MEDIA_TAG_RE.split(content)


class JinjaChat:
    """A compiled chat template and the role headers learnt from it; `render` reads a conversation's spans.

    Raises:
        ChatTemplateError: the template does not compile, or its probe conversations do not show one header per
            role before the content (templates that reorder or merge messages).
    """

    def __init__(
        self,
        source: str,
        variables: dict[str, str] | None = None,
        origin: str = "chat template",
        limits: TemplateLimits | None = None,
    ):
        self.origin = origin
        self._template = _compile(source, limits or TemplateLimits(), origin)
        self._variables = dict(variables or {})
        written = self._media_forms()
        self.takes_parts = written is not None
        self.media: dict[str, str] = written or {tag: forms[0] for tag, forms in MEDIA_FORMS.items()}
        self.trims_text = self._trims_text()
        self.headers, self.default_turn = self._learn_headers()
        self.default_system = self._default_system_text()

    def render_text(self, messages: Sequence[tuple[str, str]], add_generation_prompt: bool = False) -> str:
        """The template's text of `messages` (mmpack (role, content) pairs with `<image>` / `<video>` tags)."""
        hf = [self._hf_message(role, content) for role, content in messages]
        return self._render_hf(hf, add_generation_prompt, sum(len(r) + len(c) for r, c in messages))

    def _render_hf(
        self, messages: list[dict], add_generation_prompt: bool = False, input_chars: int = 0
    ) -> str:
        """The rendered text, under the template's limits.

        Raises:
            ChatTemplateLimitError: the render went past a limit (time, output, size, depth), or ran out of
                memory, recursion or number range; the message names the template file.
            ChatTemplateError: the template fails on this conversation (its own error, a type error, ...).
        """
        import jinja2

        env = self._template.environment
        try:
            with env.rendering(input_chars + sum(map(len, self._variables.values()))) as budget:
                text = str(
                    self._template.render(
                        messages=messages, add_generation_prompt=add_generation_prompt, **self._variables
                    )
                )
                budget.check_length(len(text))
            return text
        except ChatTemplateLimitError as exc:
            what = exc.message
        except MemoryError:
            what = "ran out of memory"
        except RecursionError:
            what = "recursed too deep (a macro that calls itself without end?)"
        except OverflowError as exc:
            what = f"computed a number out of range ({_one_line(exc)})"
        except (jinja2.exceptions.TemplateError, TypeError, ValueError) as exc:
            raise ChatTemplateError(f"{self.origin} fails on this conversation: {_one_line(exc)}") from None
        except OSError:  # not the template's: the process's own (an alarm, a signal turned into an error)
            raise
        except Exception as exc:  # any other error of the template's own code: one line, not a traceback
            raise ChatTemplateError(f"{self.origin} fails on this conversation: {_describe(exc)}") from None
        raise ChatTemplateLimitError(f"{self.origin}: the chat template {what}; {LIMIT_ADVICE}")

    def _hf_message(self, role: str, content: str) -> dict:
        if not MEDIA_TAG_RE.search(content):
            return {"role": role, "content": content}
        if not self.takes_parts:
            return {"role": role, "content": _with_qwen_placeholders(content)}
        parts: list[dict] = []
        for j, piece in enumerate(_pieces(content)):
            if j % 2:
                parts.append({"type": "image" if piece == IMAGE_TAG else "video"})
            elif piece:
                parts.append({"type": "text", "text": piece})
        return {"role": role, "content": parts}

    def _media_forms(self) -> dict[str, str] | None:
        """What the template writes for an image part and a video part (a form of MEDIA_FORMS each); None where
        it takes no image part (a text model's template)."""
        found: dict[str, str] = {}
        for tag, kind in ((IMAGE_TAG, "image"), (VIDEO_TAG, "video")):
            probe = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": _PROBES[0]}]}]
            try:
                text = self._render_hf(probe)
            except ChatTemplateError:
                text = ""
            written = [form for form in MEDIA_FORMS[tag] if text.count(form) == 1]
            if len(written) == 1:
                found[tag] = written[0]
            elif tag == IMAGE_TAG:
                return None
        return {tag: found.get(tag, MEDIA_FORMS[tag][0]) for tag in MEDIA_FORMS}

    def _trims_text(self) -> bool:
        """Whether the template writes a message's text trimmed (Gemma 4's trims each text part)."""
        padded = f" {_PROBES[1]} "
        text = self.render_text([("user", f"{IMAGE_TAG}{padded}" if self.takes_parts else padded)])
        return padded not in text and _PROBES[1] in text

    def _learn_headers(self) -> tuple[dict[str, str], str]:
        """Each role's header (what the template writes before a message's content when a system message comes
        first) and the turn it adds before a conversation without a system message (its default system turn)."""
        a, b, _ = _PROBES
        system_only = self.render_text([("system", a)])
        headers = {"system": self._before(system_only, a, "a system message")}
        for role in ("user", "assistant"):
            text = self.render_text([("system", a), (role, b)])
            if not text.startswith(system_only):
                raise ChatTemplateError(
                    f"{self.origin} writes the system message differently once a {role} message follows; "
                    "mmpack cannot read such a template: pass --chat-template builtin or another template"
                )
            headers[role] = self._before(text[len(system_only) :], b, f"a {role} message")
        plain = self.render_text([("user", b)])
        start = plain.find(headers["user"])
        if start < 0:
            raise ChatTemplateError(
                f"{self.origin} writes no user header for a conversation without a system one"
            )
        return headers, plain[:start]

    def _before(self, text: str, probe: str, what: str) -> str:
        if text.count(probe) != 1:
            raise ChatTemplateError(f"{self.origin} does not write the content of {what} once as given")
        return text[: text.index(probe)]

    def _default_system_text(self) -> str | None:
        """The system prompt of the default system turn, where it is one the template writes for a system message."""
        if not self.default_turn:
            return None
        a = _PROBES[0]
        system_only = self.render_text([("system", a)])
        head, tail = system_only.split(a)
        turn = self.default_turn
        if turn.startswith(head) and turn.endswith(tail) and len(turn) >= len(head) + len(tail):
            return turn[len(head) : len(turn) - len(tail)]
        return None

    def render(self, messages: Sequence[tuple[str, str]], *, drop_default_turn: bool = False) -> RenderedChat:
        """The text of `messages` and its spans; `drop_default_turn` leaves out the default system turn."""
        text = self.render_text(messages)
        if drop_default_turn and self.default_turn and messages and messages[0][0] != "system":
            if not text.startswith(self.default_turn):
                raise ChatTemplateError(
                    f"{self.origin} does not start this conversation with its default system turn"
                )
            text = text[len(self.default_turn) :]
        return self._read_spans(text, messages)

    def _read_spans(self, text: str, messages: Sequence[tuple[str, str]]) -> RenderedChat:
        out = RenderedChat(text)
        pos = 0
        starts, content_ends, header_ends = [], [], []
        for k, (role, content) in enumerate(messages):
            start = text.find(self.headers[role], pos)
            if start < 0:
                raise ChatTemplateError(f"{self.origin}: message {k} ({role}) has no header where it must be")
            pos = start + len(self.headers[role])
            header_ends.append(pos)
            for j, piece in enumerate(_pieces(content)):
                pos = self._find_piece(text, piece, pos, bool(j % 2), k, out)
            starts.append(start)
            content_ends.append(pos)
        if sum(text.count(p) for p in self.media.values()) != len(out.media_char_spans):
            raise ChatTemplateError(
                f"{self.origin} writes other vision pads than one per <image> / <video> tag"
            )
        for k, (role, _) in enumerate(messages):
            end = starts[k + 1] if k + 1 < len(messages) else len(text)
            out.message_ends.append(end)
            if role == "assistant":
                out.target_spans.append((header_ends[k], max(header_ends[k], len(text[:end].rstrip()))))
        return out

    def _find_piece(self, text: str, piece: str, pos: int, is_tag: bool, k: int, out: RenderedChat) -> int:
        needle = self.media[piece] if is_tag else piece.strip() if self.trims_text else piece
        if not needle:
            return pos
        at = text.find(needle, pos)
        if at < 0:
            what = f"its {piece} placeholder {needle}" if is_tag else "its text as given"
            raise ChatTemplateError(f"{self.origin}: message {k} does not hold {what}")
        end = at + len(needle)
        if is_tag:
            out.media_char_spans.append((piece, at, end))
        return end


def _with_qwen_placeholders(content: str) -> str:
    vs, ve = SPECIAL_TOKENS["vision_start"], SPECIAL_TOKENS["vision_end"]
    return MEDIA_TAG_RE.sub(lambda m: vs + PADS[m.group(0)] + ve, content)
