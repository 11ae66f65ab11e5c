"""Pieces of the DSL that need no server: choice methods, dtype conversion, chat templates, torch-free import."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.chat import ChatTemplate, get_chat_template
from frontend.choices import (
    greedy_token_selection,
    mean_logprob,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from frontend.dtypes import DtypeError, convert, normalize_dtype

ROOT = Path(__file__).resolve().parents[2]


def test_import_without_torch() -> None:
    code = ("import frontend, frontend.backends, frontend.backends.engine, sys; "
            "assert 'torch' not in sys.modules, 'frontend imported torch'; "
            "assert 'runtime' not in sys.modules and 'transformers' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def entries(*lps: float | None) -> list[list[object]]:
    return [[lp, i, f"t{i}"] for i, lp in enumerate(lps)]


def test_token_length_normalized_prefers_best_mean() -> None:
    cands = [entries(-1.0, -3.0), entries(-1.5), entries(None, -1.9, -2.1)]
    norm = [mean_logprob(e) for e in cands]
    assert norm == [-2.0, -1.5, -2.0]
    d = token_length_normalized(choices=["a", "b", "c"], normalized_prompt_logprobs=norm,
                                input_token_logprobs=cands, output_token_logprobs=[[], [], []])
    assert d.decision == "b"
    assert d.meta_info is not None and d.meta_info["normalized_prompt_logprobs"] == norm


def test_ties_pick_the_first_choice() -> None:
    d = token_length_normalized(choices=["x", "y"], normalized_prompt_logprobs=[-1.0, -1.0],
                                input_token_logprobs=[entries(-1.0), entries(-1.0)], output_token_logprobs=[[], []])
    assert d.decision == "x"
    assert mean_logprob([]) == -math.inf


def test_greedy_token_selection_pads_short_choices_with_their_mean() -> None:
    # Equal first token; then "long" has -0.5 while "short" is padded with its mean (-1.0).
    cands = [entries(-1.0), entries(-1.0, -0.5), entries(-2.0, 0.0)]
    d = greedy_token_selection(choices=["short", "long", "bad"], normalized_prompt_logprobs=[0, 0, 0],
                               input_token_logprobs=cands, output_token_logprobs=[[], [], []])
    assert d.decision == "long"
    assert d.meta_info is not None and d.meta_info["greedy_logprob_matrix"][0] == [-1.0, -1.0]


def test_unconditional_likelihood_normalized() -> None:
    cond = [entries(-1.0, -1.0), entries(-2.0, -2.0)]
    uncond = [entries(None, -0.1), entries(None, -5.0)]  # "b" is unlikely on its own: the context favours it
    d = unconditional_likelihood_normalized(choices=["a", "b"], normalized_prompt_logprobs=[-1.0, -2.0],
                                            input_token_logprobs=cond, output_token_logprobs=[[], []],
                                            unconditional_token_logprobs=uncond)
    assert d.decision == "b"
    with pytest.raises(ValueError):
        unconditional_likelihood_normalized(choices=["a"], normalized_prompt_logprobs=[0.0],
                                            input_token_logprobs=[entries(-1.0)], output_token_logprobs=[[]])


@pytest.mark.parametrize(("text", "dtype", "value"), [
    ("42", "int", 42), (" -7 \n", "int", -7), ("+3", "int", 3), ("12abc", "int", 12),
    ("3.25", "float", 3.25), ("-.5", "float", -0.5), ("7", "float", 7.0), ("3.", "float", 3.0),
    ("True", "bool", True), ("False", "bool", False), ("Tr", "bool", True),
    ('"hello world"', "str", "hello world"), ('"cut sho', "str", "cut sho"), ("plain", "str", "plain"),
])
def test_convert(text: str, dtype: str, value: object) -> None:
    out = convert(text, dtype)
    assert out == value and type(out) is type(value)


@pytest.mark.parametrize(("text", "dtype"), [("abc", "int"), ("-", "int"), ("-.", "float"), ("maybe", "bool")])
def test_convert_failure_is_a_clear_error(text: str, dtype: str) -> None:
    with pytest.raises(DtypeError, match="constrained"):
        convert(text, dtype)


def test_normalize_dtype() -> None:
    assert [normalize_dtype(t) for t in (int, float, bool, str, "int", "string", None)] == [
        "int", "float", "bool", "str", "int", "str", None]
    with pytest.raises(ValueError):
        normalize_dtype(list)


# ---------------------------------------------------------------------------- chat templates
def smollm_template(tiny_model_dir: Path) -> str:
    return (tiny_model_dir / "chat_template.jinja").read_text()


def test_template_matches_the_tokenizer(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tpl = ChatTemplate.from_jinja(smollm_template(tiny_model_dir))
    assert tpl.default_system_prompt and "SmolLM" in tpl.default_system_prompt
    for msgs in ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "a"},
                  {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]):
        expected = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        assert tpl.render(msgs, add_generation_prompt=True) == expected


def test_template_without_jinja2(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with_jinja = ChatTemplate.from_jinja(smollm_template(tiny_model_dir))
    monkeypatch.setitem(sys.modules, "jinja2", None)  # "import jinja2" now raises ImportError
    without = ChatTemplate.from_jinja(smollm_template(tiny_model_dir))
    assert without == with_jinja
    assert ChatTemplate.from_jinja("{{ bos_token }}[INST] {{ messages[0]['content'] }}") == ChatTemplate.chatml()


LLAMA3_LIKE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")


def test_template_of_another_family() -> None:
    tpl = ChatTemplate.from_jinja(LLAMA3_LIKE, bos_token="<|begin_of_text|>")
    assert tpl.get_prefix_and_suffix("user") == ("<|start_header_id|>user<|end_header_id|>\n\n", "<|eot_id|>")
    assert tpl.default_system_prompt is None
    assert tpl.stop_str == ("<|eot_id|>",)


QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def test_template_that_cannot_render_an_empty_conversation(monkeypatch: pytest.MonkeyPatch) -> None:
    tpl = ChatTemplate.from_jinja(QWEN_LIKE)
    assert tpl == ChatTemplate.chatml("You are Qwen, a helpful assistant.")
    monkeypatch.setitem(sys.modules, "jinja2", None)
    assert ChatTemplate.from_jinja(QWEN_LIKE) == tpl


def test_builtin_templates() -> None:
    assert get_chat_template("chatml").get_prefix_and_suffix("user") == ("<|im_start|>user\n", "<|im_end|>\n")
    assert get_chat_template("plain").render([{"role": "user", "content": "x"}]) == "x"
    with pytest.raises(ValueError):
        get_chat_template("nope")
