"""Chat templates: parity with transformers' apply_chat_template, the sandbox, the checks on messages, where a
model's template comes from (checkpoint, --chat-template, default) and the errors a template's failure gives."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from model.chat_template import (
    DEFAULT_CHAT_TEMPLATE,
    DEFAULT_TEMPLATE,
    ROLES,
    ChatTemplate,
    ChatTemplateError,
    load_chat_template,
    resolve_chat_template,
    special_tokens,
)
from model.checkpoint import load_checkpoint, save_checkpoint
from model.gpt import GPT
from model.registry import ModelRegistry
from model.sampling_params import ValidationError
from model.tokenizer import CharTokenizer, TokenizerError

TEMPLATES = Path(__file__).parent / "chat_templates"
CHATML = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + \
'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
BUNDLED = Path(__file__).parents[2] / "weights" / "shakespeare-char"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city <b>exactly</b> & briefly, in °C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "e.g. Zürich"}},
               "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "the time", "parameters": {"type": "object"}}}
CONVERSATIONS = {
    "system and user": [{"role": "system", "content": "You are terse.  "}, {"role": "user", "content": "Hi <there> é"}],
    "no system": [{"role": "user", "content": "What's 2+2?"}, {"role": "assistant", "content": "4"},
                  {"role": "user", "content": "And 3+3?"}],
    "tool call and results": [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
        {"role": "user", "content": "Thanks"}],
}


def _hf_tokenizer():
    """A transformers tokenizer with bos/eos tokens, built in memory (apply_chat_template needs no vocabulary)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|begin_of_text|>": 1, "<|eot_id|>": 2}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")


# plain ChatML renders a message's content only, and a tool call's null content fails there (here it is ''): it gets
# no conversation with a call
PARITY_CASES = [(t, c) for t in ("chatml", "chatml_tools.jinja", "llama3_tools.jinja") for c in CONVERSATIONS
                if not (t == "chatml" and c == "tool call and results")]


@pytest.mark.parametrize("template_name, conversation", PARITY_CASES)
@pytest.mark.parametrize("with_tools", [False, True], ids=["no-tools", "tools"])
@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["prompt", "no-prompt"])
def test_renders_exactly_as_transformers(template_name: str, conversation: str, with_tools: bool,
                                         add_generation_prompt: bool) -> None:
    tok = _hf_tokenizer()
    text = CHATML if template_name == "chatml" else (TEMPLATES / template_name).read_text()
    messages = CONVERSATIONS[conversation]
    tools = [WEATHER, CLOCK] if with_tools else None
    want = tok.apply_chat_template(messages, tools=tools, chat_template=text, tokenize=False,
                                   add_generation_prompt=add_generation_prompt)
    got = ChatTemplate(text, "checkpoint").render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                  **special_tokens(tok))
    assert got == want
    assert (got.endswith("assistant\n") or got.endswith("<|end_header_id|>\n\n")) == add_generation_prompt


def test_the_parity_cases_reach_tools_and_calls() -> None:
    """The templates above do read the tools and the calls (a parity test over text they ignore would prove less)."""
    got = ChatTemplate((TEMPLATES / "llama3_tools.jinja").read_text(), "x").render(
        CONVERSATIONS["tool call and results"], tools=[WEATHER], bos_token="<s>")
    assert got.startswith("<s><|start_header_id|>system")
    assert '"description": "Today\'s weather in a city <b>exactly</b> & briefly, in °C"' in got  # not HTML-escaped
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}' in got
    assert "<|start_header_id|>ipython<|end_header_id|>\n\n{\"temp\": 21}" in got
    chatml = ChatTemplate((TEMPLATES / "chatml_tools.jinja").read_text(), "x")
    assert chatml.reads_tools and not DEFAULT_TEMPLATE.reads_tools


def test_a_raising_template_names_its_source_and_message() -> None:
    template = ChatTemplate((TEMPLATES / "llama3_tools.jinja").read_text(), "checkpoint")
    two_calls = [{"role": "user", "content": "a"}, {"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}, {"function": {"name": "g", "arguments": "{}"}}]}]
    with pytest.raises(ChatTemplateError) as e:
        template.render(two_calls)
    assert isinstance(e.value, ValidationError) and isinstance(e.value, ValueError)
    assert e.value.field == "messages"
    assert str(e.value) == ("messages: the chat template (checkpoint) cannot render them: the template raised: one "
                            "tool call per turn, got 2")
    with pytest.raises(jinja2.TemplateError, match="^one tool call per turn, got 2$"):  # transformers refuses it too
        _hf_tokenizer().apply_chat_template(two_calls, chat_template=template.text, tokenize=False)


@pytest.mark.parametrize("text, reason", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "refused by the sandbox"),
    ("{{ messages.__class__ }}{{ messages.__class__.__base__ }}", "refused by the sandbox"),
    ("{{ lipsum.__globals__['os'].system('echo owned') }}", "refused by the sandbox"),
    ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "refused by the sandbox"),
    ("{{ raise_exception.__globals__ }}{{ raise_exception.__globals__['json'] }}", "refused by the sandbox"),
    ("{% set ns = namespace() %}{% set ns._hidden = 1 %}", "refused by the sandbox: a namespace cannot hold"),
    ("{{ messages.append(1) }}", "refused by the sandbox"),  # immutable: the caller's data is not changed
    ("{{ os.system('echo owned') }}", "undefined value: 'os' is undefined"),
    ("{{ self.__init__.__globals__ }}", "refused by the sandbox"),
])
def test_the_sandbox_refuses_reaching_python(text: str, reason: str, capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ChatTemplateError, match="cannot render them: " + reason.replace("(", r"\(")):
        ChatTemplate(text, "checkpoint").render([{"role": "user", "content": "hi"}])
    assert "owned" not in capfd.readouterr().out


def test_an_unsafe_attribute_shown_renders_nothing() -> None:
    """Printing an attribute the sandbox hides gives '' (as in transformers), never the object."""
    assert ChatTemplate("[{{ ''.__class__ }}]", "default").render([{"role": "user", "content": "x"}]) == "[]"


@pytest.mark.parametrize("text, reason", [
    ("{% for m in messages %}{{ m.content }}", "syntax error at line 1: Unexpected end of template"),
    ("{{ messages[0].content + 1 }}", "TypeError: can only concatenate str"),
    ("{{ 1 / (messages | length - 1) }}", "ZeroDivisionError: division by zero"),
    ("{{ nothing.here }}", "undefined value: 'nothing' is undefined"),
])
def test_a_failing_template_is_a_validation_error_naming_source_and_reason(text: str, reason: str) -> None:
    for source in ("checkpoint", "--chat-template /etc/t.jinja", "default"):
        with pytest.raises(ChatTemplateError) as e:
            ChatTemplate(text, source).render([{"role": "user", "content": "hi"}])
        assert str(e.value).startswith(f"messages: the chat template ({source}) cannot render them: {reason}")
        assert len(str(e.value)) < 400


def test_a_developer_message_is_the_systems_instructions() -> None:
    """OpenAI's 'developer' role (its newer name for 'system'): a template renders it as a system message."""
    conversation = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert DEFAULT_TEMPLATE.render(conversation) == DEFAULT_TEMPLATE.render(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])


@pytest.mark.parametrize("messages, field, fragment", [
    ([], "messages", "must be a non-empty list of messages, got []"),
    ("hello", "messages", "must be a non-empty list of messages, got 'hello'"),
    ([{"role": "user", "content": "a"}, "b"], "messages[1]", "must be an object with a role and a content"),
    ([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "robot", "content": "c"}],
     "messages[2].role", "must be one of 'system', 'user', 'assistant', 'tool' or 'developer', got 'robot'"),
    ([{"content": "a"}], "messages[0].role", "got None"),
    ([{"role": "user", "content": 5}], "messages[0].content", "must be a string or a list of text parts, got 5"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}],
     "messages[0].content[1].type", "must be 'text' (only text parts are supported), got 'image_url'"),
    ([{"role": "user", "content": ["a"]}], "messages[0].content[0]", "must be a text part"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "must be a string, got None"),
    ([{"role": "user", "content": "a", "extra": {"when": object()}}], "messages[0].extra.when",
     "must be JSON data, got a object"),
])
def test_messages_that_are_no_conversation_name_the_field(messages: object, field: str, fragment: str) -> None:
    with pytest.raises(ValidationError) as e:
        DEFAULT_TEMPLATE.render(messages)
    assert not isinstance(e.value, ChatTemplateError)
    assert e.value.field == field and str(e.value) == f"{field}: {e.value.message}" and fragment in e.value.message


@pytest.mark.parametrize("tools, field", [("f", "tools"), ([WEATHER, "f"], "tools[1]")])
def test_tools_must_be_objects(tools: object, field: str) -> None:
    with pytest.raises(ValidationError) as e:
        DEFAULT_TEMPLATE.render([{"role": "user", "content": "a"}], tools=tools)
    assert e.value.field == field


def test_text_parts_are_joined_as_vllm_joins_them() -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]
    assert ChatTemplate(CHATML, "x").render(parts) == ChatTemplate(CHATML, "x").render(
        [{"role": "user", "content": "one\ntwo"}])


def test_the_callers_messages_are_not_changed() -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    before = json.dumps(messages)
    DEFAULT_TEMPLATE.render(messages)
    assert json.dumps(messages) == before


def test_default_template_shape() -> None:
    got = DEFAULT_TEMPLATE.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"},
                                   {"role": "assistant", "content": "Hail."}, {"role": "user", "content": "Bye",
                                                                                "name": "romeo"}])
    assert got == "SYSTEM:\nBe brief.\n\nUSER:\nHello\n\nASSISTANT:\nHail.\n\nROMEO:\nBye\n\nASSISTANT:\n"
    assert DEFAULT_TEMPLATE.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False) == "USER:\nHi\n\n"


def test_default_template_speaks_the_bundled_models_characters() -> None:
    """Everything the default template adds to the messages' text is in the bundled character vocabulary, so a
    conversation in those characters encodes for it."""
    tok = load_checkpoint(BUNDLED).tokenizer
    assert isinstance(tok, CharTokenizer)
    messages = [{"role": role, "content": "Speak, friend!"} for role in ROLES]
    rendered = DEFAULT_TEMPLATE.render(messages, tools=[WEATHER], **special_tokens(tok))
    assert len(tok.encode(rendered)) == len(rendered)
    added = rendered
    for m in messages:
        added = added.replace(m["content"], "", 1)
    assert set(added) <= set(tok.chars) and set(added) == set("SYSTEMUERAIONL:\n")
    assert special_tokens(tok) == {}  # a character vocabulary has neither


def test_compiled_templates_are_cached() -> None:
    from model import chat_template

    text = "{{ messages | length }} cached"
    chat_template._compiled.cache_clear()
    for source in ("a", "b"):
        assert ChatTemplate(text, source).render([{"role": "user", "content": "x"}]) == "1 cached"
    info = chat_template._compiled.cache_info()
    assert (info.misses, info.hits) == (1, 1)


# --- where a template comes from -------------------------------------------------------------------------------


def test_chat_template_flag_reads_a_file_or_takes_the_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(CHATML, encoding="utf-8")
    from_file = load_chat_template(str(path))
    assert from_file == ChatTemplate(CHATML, f"--chat-template {path}")
    assert load_chat_template(CHATML) == ChatTemplate(CHATML, "--chat-template")
    assert load_chat_template(None) is None


@pytest.mark.parametrize("value, fragment", [
    ("templates/missing.jinja", "no file 'templates/missing.jinja' found, and it is no template either"),
    ("{% if %}", "the chat template (--chat-template) does not compile: syntax error at line 1"),
])
def test_chat_template_flag_refusals(value: str, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        load_chat_template(value)
    assert fragment in str(e.value)


def test_a_chat_template_file_that_does_not_compile_is_named(tmp_path: Path) -> None:
    path = tmp_path / "broken.jinja"
    path.write_text("{% for m in messages %}", encoding="utf-8")
    with pytest.raises(ValueError, match=f"the chat template \\(--chat-template {path}\\) does not compile"):
        load_chat_template(str(path))


def test_resolution_order() -> None:
    flag = ChatTemplate(CHATML, "--chat-template")
    assert resolve_chat_template("{{ 'mine' }}", flag) == ChatTemplate("{{ 'mine' }}", "checkpoint")
    assert resolve_chat_template(None, flag) is flag
    assert resolve_chat_template(None) is DEFAULT_TEMPLATE and DEFAULT_TEMPLATE.text == DEFAULT_CHAT_TEMPLATE


def test_checkpoint_carries_its_template(tmp_path: Path, tiny_model: GPT) -> None:
    chars = [chr(c) for c in range(32, 32 + 64)] + ["\n"]
    saved = save_checkpoint(tmp_path / "with", tiny_model, CharTokenizer(chars, chat_template=CHATML))
    assert json.loads((saved / "config.json").read_text())["tokenizer"]["chat_template"] == CHATML
    assert load_checkpoint(saved).chat_template == CHATML
    plain = save_checkpoint(tmp_path / "without", tiny_model, CharTokenizer(chars))
    assert "chat_template" not in json.loads((plain / "config.json").read_text())["tokenizer"]
    assert load_checkpoint(plain).chat_template is None


def test_a_checkpoint_template_that_is_not_text_is_refused() -> None:
    with pytest.raises(TokenizerError, match="a chat template must be a string"):
        CharTokenizer(["a"], chat_template=["{{ x }}"])  # type: ignore[arg-type]


def test_the_registry_resolves_each_checkpoints_template(tmp_path: Path, tiny_model: GPT) -> None:
    chars = [chr(c) for c in range(32, 32 + 64)] + ["\n"]
    carries = load_checkpoint(save_checkpoint(tmp_path / "a", tiny_model, CharTokenizer(chars, chat_template=CHATML)))
    bare = load_checkpoint(save_checkpoint(tmp_path / "b", tiny_model, CharTokenizer(chars)))
    flag = ChatTemplate("{{ messages[0].content }}!", "--chat-template")

    def never(path: Path):
        raise AssertionError("nothing is loaded")

    with_flag = ModelRegistry({"a": tmp_path / "a", "b": tmp_path / "b"}, never, chat_template=flag)
    assert with_flag.chat_template(carries) == ChatTemplate(CHATML, "checkpoint")
    assert with_flag.chat_template(bare) is flag
    assert ModelRegistry({"b": tmp_path / "b"}, never).chat_template(bare) is DEFAULT_TEMPLATE
