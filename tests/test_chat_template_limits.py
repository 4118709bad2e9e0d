"""A model folder's chat template renders under limits (time, output, depth, numbers): nested `range(100000)`
loops, `'x' * 4000000000`, a macro calling itself and `range(10**12)` each end in one line naming the template
file (no hang, no MemoryError / RecursionError / OverflowError traceback), at the flags' check and in the offline
job's worker processes; ordinary templates render exactly as in jinja2's plain sandbox (the control); any
template and conversation give a text or mmpack's one-line error (hypothesis)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmpack.cli import main as mmpack_main
from mmpack.offline_packing.model_folder import resolve_chat_template
from mmpack.packing.jinja_chat import ChatTemplateError, JinjaChat
from mmpack.packing.template_limits import ChatTemplateLimitError, TemplateLimits
from mmpack.packing.tokenizer import BYTE_TOKENIZER
from tests.support.fixtures_chat import QWEN2_VL_CHAT_TEMPLATE
from tests.support.timeouts import deadline

# a chat template mmpack can follow; each hostile piece below is put in front of it
PLAIN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
HOSTILE = {
    "nested_range_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "nested_loops_over_one_list": "{% set r = range(100000) %}{% for i in r %}{% for j in r %}{% endfor %}"
    "{% endfor %}",  # no call, operator or output inside: only the loops' own check ends it
    "nested_loops_writing": "{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}",
    "loops_in_a_macro": "{% macro m() %}{% for i in range(100000) %}{% for c in 'x' * 100000 %}{{ c }}"
    "{% endfor %}{% endfor %}{% endmacro %}{% set s = m() %}",
    "huge_repeat": "{{ 'x' * 4000000000 }}",
    "huge_center": "{{ 'x'|center(4000000000) }}",
    "huge_ljust": "{{ 'x'.ljust(4000000000) }}",
    "doubling_in_a_namespace": "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
    "{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
    "doubling_by_set": "{% set s = 'x' * 1000000 %}" + "{% set s = s + s %}" * 40,
    "replace_empty": "{% set s = 'y' * 100000 %}{{ s.replace('', s) }}",
    "recursive_macro": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
    "huge_range": "{% for i in range(10**12) %}{% endfor %}",
    "huge_power": "{{ 2 ** 100000000 }}",
    "percent_width": "{{ '%999999999d' % 1 }}",
}
FAST = TemplateLimits(timeout_s=0.3)


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_template_is_one_line_naming_the_file(name: str) -> None:
    started = time.monotonic()
    with deadline(20), pytest.raises(ChatTemplateLimitError) as info:
        JinjaChat(HOSTILE[name] + PLAIN, origin="/models/m/chat_template.jinja", limits=FAST)
    message = info.value.message
    assert message.startswith("/models/m/chat_template.jinja: the chat template ") and "\n" not in message
    assert "--chat-template builtin" in message  # what to do
    # the time limit (0.3 s) ends the loops; the others are refused at once
    assert time.monotonic() - started < 5


def test_the_control_template_passes_the_same_limits() -> None:
    """Control: the template the hostile pieces are put in front of renders under the same limits."""
    chat = JinjaChat(PLAIN, limits=FAST)
    assert chat.render_text([("user", "hi")]) == "<|im_start|>user\nhi<|im_end|>\n"


def test_time_limit_is_the_one_given() -> None:
    """The loops run until the deadline, not until some other check: 0.3 s and 1.2 s limits take about as long."""
    for timeout_s in (0.3, 1.2):
        started = time.monotonic()
        with pytest.raises(ChatTemplateLimitError, match=f"time limit of {timeout_s:g} s"):
            JinjaChat(HOSTILE["nested_range_loops"] + PLAIN, limits=TemplateLimits(timeout_s=timeout_s))
        assert timeout_s <= time.monotonic() - started < timeout_s + 1.5


def test_output_limit_grows_with_the_conversation() -> None:
    """A long record renders (its text counts towards its own limit); a template multiplying it does not."""
    limits = TemplateLimits(max_output_chars=1000, output_per_input_char=4)
    long = "word " * 2000  # 10,000 characters: past the fixed part of the limit
    assert long in JinjaChat(PLAIN, limits=limits).render_text([("user", long)])
    long_tenfold = (
        "{% if m['content']|length > 5000 %}{{ m['content'] * 10 }}{% else %}{{ m['content'] }}{% endif %}"
    )
    tenfold = PLAIN.replace("{{ m['content'] }}", long_tenfold)
    chat = JinjaChat(tenfold, limits=limits)  # the probe conversations are short: it passes them
    with pytest.raises(ChatTemplateLimitError, match="output limit"):
        chat.render_text([("user", long)])


def _render(source: str, *, bounded: bool, **context: object) -> str:
    """`source` in jinja2's own sandbox with transformers' options, with (`bounded`) or without mmpack's limits."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from mmpack.packing.bounded_jinja import BoundedEnvironment

    options = dict(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env = (
        BoundedEnvironment(TemplateLimits(), **options)
        if bounded
        else ImmutableSandboxedEnvironment(**options)
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    if not bounded:
        return env.from_string(source).render(**context)
    template = env.compile_bounded(source)
    with env.rendering(0):
        return template.render(**context)


FEATURES = (  # loops (loop.*, else, filters, recursive, break), macros with caller, namespaces, set blocks
    "{% set ns = namespace(n=0) %}{% for m in messages if m['role'] != 'x' %}{% set ns.n = ns.n + loop.index %}"
    "{{ loop.index0 }}/{{ loop.length }}{{ '!' if loop.last }}{{ loop.cycle('a', 'b') }}"
    "{% if loop.index > 5 %}{% break %}{% endif %}{% else %}none{% endfor %}{{ ns.n }}"
    "{% macro box(x) %}[{{ x ~ caller() }}]{% endmacro %}{% call box('k') %}in{% endcall %}"
    "{% set tree = [{'n': 1, 'c': [{'n': 2, 'c': []}]}] %}"
    "{% for t in tree recursive %}{{ t.n }}{{ loop(t.c) }}{% endfor %}"
    "{% set block %}{% for i in range(3) %}{{ i * 2 }},{% endfor %}{% endset %}{{ block|trim(',') }}"
    "{{ messages|tojson(indent=2) }}{{ '%05.1f|%s' % (3.14159, 'x') }}{{ '{:>6}'.format('r') }}"
    "{{ 'a,b'.split(',')|join('+') }}{{ (2 ** 10) + [1, 2]|length }}{{ 'ab' * 3 }}{{ 'x'|center(7) }}"
)
MESSAGES = [("system", "Be kind."), ("user", "Hi <b>there</b>"), ("assistant", "Hello."), ("user", "Again?")]


@pytest.mark.parametrize("source", [QWEN2_VL_CHAT_TEMPLATE, FEATURES + PLAIN], ids=["qwen2_vl", "features"])
def test_bounded_rendering_equals_the_plain_sandbox(source: str) -> None:
    hf = [{"role": r, "content": c} for r, c in MESSAGES]
    for prompt in (False, True):
        expected = _render(source, bounded=False, messages=hf, add_generation_prompt=prompt)
        assert _render(source, bounded=True, messages=hf, add_generation_prompt=prompt) == expected
    expected = _render(QWEN2_VL_CHAT_TEMPLATE, bounded=False, messages=hf, add_generation_prompt=False)
    # and through mmpack's renderer
    assert JinjaChat(QWEN2_VL_CHAT_TEMPLATE).render_text(MESSAGES) == expected


def test_control_the_plain_sandbox_comparison_sees_a_change() -> None:
    """Control: the comparison above fails where the bounded render differs (one character changed)."""
    hf = [{"role": r, "content": c} for r, c in MESSAGES]
    expected = _render(FEATURES + PLAIN, bounded=False, messages=hf)
    changed = _render((FEATURES + PLAIN).replace("center(7)", "center(8)"), bounded=True, messages=hf)
    assert changed != expected and len(changed) == len(expected) + 1


def test_model_folder_breach_is_refused_when_flags_are_read(tmp_path: Path) -> None:
    """`mmpack pack --model DIR` (here its resolver) refuses a folder whose template breaks a limit on the probe
    conversations: a ValueError of one line naming the folder's chat_template.jinja."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "chat_template.jinja").write_text(HOSTILE["recursive_macro"] + PLAIN)
    with pytest.raises(
        ValueError, match=r"model/chat_template\.jinja: the chat template nests calls"
    ) as info:
        resolve_chat_template(str(folder), None, None)
    assert "\n" not in str(info.value)
    (folder / "chat_template.jinja").write_text(PLAIN)  # control: the same folder with a plain template
    assert resolve_chat_template(str(folder), None, None)["chat_source"] == PLAIN


def test_breach_on_one_sample_in_the_job_workers_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A template that passes the probes but allocates without bound on one record stops `mmpack pack` (two local
    worker processes render the lengths stage) with one line naming the record and the template file."""
    template = tmp_path / "bomb.jinja"
    bomb = "{% if 'BOMB' in m['content'] %}{{ 'x' * 4000000000 }}{% endif %}"
    template.write_text(PLAIN.replace("{{ m['content'] }}", bomb + "{{ m['content'] }}"))
    records = tmp_path / "in.jsonl"
    rows = [
        [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}] for i in range(8)
    ]
    rows[5][0]["content"] = "BOMB"
    records.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    argv = ["pack", "-i", str(records), "-o", str(tmp_path / "out"), "-L", "256", "-t", BYTE_TOKENIZER]
    argv += ["--chat-template", str(template), "-w", "2", "--chunk-size", "2", "--no-progress"]
    with deadline(120):
        code = mmpack_main(argv)
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.strip()]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err
    assert "in.jsonl:6" in lines[0] and "bomb.jinja: the chat template builds a value" in lines[0], err


# hypothesis: pieces of templates, good and hostile, with numbers from small to huge
NUMBERS = st.sampled_from([0, 1, 3, -2, 100, 10**5, 10**9, 10**12])
PIECES = st.sampled_from(
    [
        "{{ messages[0]['content'] }}",
        "{% for m in messages %}{{ m['role'] }}:{{ m['content'] }};{% endfor %}",
        "{{ 'x' * N }}",
        "{{ [1, 2] * N }}",
        "{% for i in range(N) %}{{ i }}{% endfor %}",
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(N) }}",
        "{{ N ** N }}",
        "{{ 'ab' ~ N ~ 'cd' }}",
        "{{ raise_exception('refused') }}",
        "{{ 1 / N }}",
        "{{ N // 0 }}",
        "{{ x.y.z }}",
        "{{ [1, 2] + 'a' }}",
        "{% set ns = namespace(s='ab') %}{% for i in range(N) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}",
        "{{ '%*d' % (N, 1) }}",
        "{{ 'a\nb'|indent(N) }}",
        "{{ messages|tojson(indent=N) }}",
        "{{ range(N)|list|length }}",
        "{{ 'a'.center(N) }}",
        "{{ '{:>{w}}'.format('a', w=N) }}",
        "{{ messages[0]['content']|replace('', 'xy') }}",
        "{{ messages.__class__ }}",
        "{{ ''.join(['a'] * N) }}",
        "{% for c in 'abc' * N %}{% for d in 'abc' * N %}{% endfor %}{% endfor %}",
        "{{ (10 ** N)|string|length }}",
        "{% if %}",
        "{{ strftime_now('%Y' * N) }}",
        "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}",
    ]
)


@st.composite
def _templates(draw: st.DrawFn) -> str:
    parts = draw(st.lists(st.tuples(PIECES, NUMBERS), min_size=1, max_size=3))
    noise = draw(st.text(alphabet="{}%#-+~|*'\"()[]. abcxN0123456789\n", max_size=20))
    return "".join(piece.replace("N", str(n)) for piece, n in parts) + noise + PLAIN


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(source=_templates(), content=st.text(max_size=40))
def test_any_template_renders_or_is_one_line(source: str, content: str) -> None:
    limits = TemplateLimits(timeout_s=0.1, max_output_chars=1 << 16, max_count=1 << 12)
    try:
        chat = JinjaChat(source, limits=limits)
        text = chat.render_text([("user", content), ("assistant", "a")])
    except (ChatTemplateError, ChatTemplateLimitError) as exc:
        assert "\n" not in exc.message and exc.message
        return
    assert isinstance(text, str) and len(text) <= limits.output_chars(len(content) + 10 + 14)
