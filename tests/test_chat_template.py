import gguf
import pytest

from pinfer.runtime.chat_template import CHATML_FALLBACK, TemplateError, render_chat
from models import chat_template_from_gguf, smollm2_gguf

CONVERSATION = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4."},
]


@pytest.fixture(scope="module")
def smollm2_template():
    return chat_template_from_gguf(gguf.GGUFReader(smollm2_gguf()))


@pytest.mark.real_model
def test_smollm2_template_renders_chatml(smollm2_template):
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
        "<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chat(smollm2_template, CONVERSATION) == expected
    without_prompt = render_chat(smollm2_template, CONVERSATION, add_generation_prompt=False)
    assert without_prompt == expected.removesuffix("<|im_start|>assistant\n")


@pytest.mark.real_model
def test_matches_transformers_rendering(smollm2_template):
    chat_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = [{"role": "system", "content": "Be brief."}, *CONVERSATION,
                {"role": "user", "content": "And 3+3? ünïcode 🦙"}]
    hf, _ = chat_utils.render_jinja_template(
        conversations=[messages], chat_template=smollm2_template, add_generation_prompt=True)
    assert render_chat(smollm2_template, messages) == hf[0]


def test_chatml_fallback():
    assert render_chat(CHATML_FALLBACK, CONVERSATION[:1]) == (
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_trim_and_lstrip_blocks():
    template = "{% for m in messages %}\n    {{ m.content }}\n{% endfor %}"
    assert render_chat(template, CONVERSATION) == "    What is 2+2?\n    4.\n"


def test_raise_exception_is_a_template_error():
    template = "{% if messages[0].role != 'system' %}{{ raise_exception('System first!') }}{% endif %}"
    with pytest.raises(TemplateError, match="System first!"):
        render_chat(template, CONVERSATION)


def test_generation_tag_renders_its_body():
    template = ("{% for m in messages %}{% if m.role == 'assistant' %}"
                "{% generation %}[{{ m.content }}]{% endgeneration %}"
                "{% else %}{{ m.content }}{% endif %}{% endfor %}")
    assert render_chat(template, CONVERSATION) == "What is 2+2?[4.]"


def test_tojson_keeps_unicode_and_indent():
    template = "{{ extra_value | tojson }}|{{ extra_value | tojson(indent=2) }}"
    out = render_chat(template, [], extra={"extra_value": {"k": "ü<&>"}})
    assert out == '{"k": "ü<&>"}|{\n  "k": "ü<&>"\n}'


def test_strftime_now_and_extra_variables():
    template = "{{ strftime_now('%Y') }} {{ tools | length }} {{ bos_token }}"
    out = render_chat(template, [], extra={"tools": [1, 2]}, bos_token="<s>")
    year, count, bos = out.split()
    assert len(year) == 4 and year.isdigit() and (count, bos) == ("2", "<s>")


def test_loop_controls():
    template = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}"
    assert render_chat(template, CONVERSATION) == "user"


def test_sandbox_blocks_python_internals():
    template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError, match="unsafe"):
        render_chat(template, CONVERSATION)


def test_namespace_refuses_underscore_names():
    template = "{% set ns = namespace(_x=1) %}{{ ns._x }}"
    with pytest.raises(TemplateError, match="underscore"):
        render_chat(template, CONVERSATION)


def test_sandbox_is_immutable():
    template = "{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}"
    with pytest.raises(TemplateError, match="unsafe"):
        render_chat(template, list(CONVERSATION))


def test_syntax_error_is_a_template_error():
    with pytest.raises(TemplateError, match="does not compile"):
        render_chat("{% for m in messages %}", CONVERSATION)


def test_runtime_error_is_a_template_error():
    with pytest.raises(TemplateError, match="failed while rendering"):
        render_chat("{{ messages[0].content + 1 }}", CONVERSATION)
