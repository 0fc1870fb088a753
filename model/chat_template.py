"""Chat templates: a conversation (OpenAI's `messages`) rendered into one prompt string, as Hugging Face's
`apply_chat_template` and vLLM render it: a Jinja2 template run in Jinja's immutable sandbox, with trim_blocks and
lstrip_blocks, the `raise_exception`, `strftime_now`, `dict` and `namespace` globals, a `tojson` filter that does not
escape HTML, loop controls and the `{% generation %}` tag, so a template from a model's `tokenizer_config.json`
renders here exactly as it does in transformers.

- Where a model's template comes from (`resolve_chat_template`): the one its checkpoint carries (`config.json`'s
  `tokenizer.chat_template`; `folio convert hf` keeps the Hugging Face repo's), else the server's `--chat-template
  FILE_OR_STRING` (`load_chat_template`: a path if it names a file, else the template's text, as vLLM reads its
  flag), else `DEFAULT_CHAT_TEMPLATE`, for base models: role-named lines ending with an `ASSISTANT:` line to
  continue, in characters the bundled character-level model knows.
- What a template sees: `messages` (roles `ROLES`; each content a string, text parts joined by newlines as vLLM
  joins them for such templates, null as ''), `tools` (or none), `add_generation_prompt`, and the tokenizer's
  `bos_token` / `eos_token` where it has them (`special_tokens`). Messages are checked before the template runs and
  passed as plain JSON data only, so a template can reach nothing but what it is given.
- Errors: a conversation that is not one (`messages[2].role` ...) is a `ValidationError` naming the field, the
  allowed values and the value; a template that cannot render it (syntax, `raise_exception`, an undefined value
  misused, an operation the sandbox refuses) a `ChatTemplateError` (a `ValidationError` of field `messages`) naming
  the template's source and the reason. The HTTP layer answers both with a 4xx, never a 500.

Compiled templates are cached by their text (`MAX_COMPILED` of them), compile errors too.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model.sampling_params import ValidationError, preview

ROLES = ("system", "user", "assistant", "tool")
CHECKPOINT, DEFAULT = "checkpoint", "default"  # sources of a template (and `--chat-template ...`)
FLAG = "--chat-template"
JINJA_CHARS = "{}\n"  # vLLM: a --chat-template value without any of these that names no file was meant as a path
MAX_COMPILED = 64
MAX_REASON_CHARS = 300
# for base models: "SYSTEM:\nBe brief.\n\nUSER:\nHello\n\nASSISTANT:\n" (a play's speakers: the bundled model's
# training text has this shape); a message's name, where given, stands for its role ("ROMEO:")
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ (message.name or message.role) | upper }}:\n"
    "{{ message.content }}\n\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:\n{% endif %}"
)


class ChatTemplateError(ValidationError):
    """A chat template that cannot render a conversation; the message names the template's source and why."""


class _Raised(jinja2.TemplateError):
    """What a template's `raise_exception(message)` raises."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks the assistant's tokens with it; here it renders
    its body, as transformers does when no mask is asked for."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: jinja2.runtime.Macro) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore names (transformers' guard against reaching Python's internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Namespace's signature: `namespace(self=...)` works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace cannot hold underscore-prefixed names, got {name!r}")


class _Dict:
    """`dict(...)` in a template: builds dicts, and exposes nothing of the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise _Raised(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    """Jinja's own `tojson` escapes <, >, & and ' for HTML; chat templates want plain JSON (transformers' filter)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                     extensions=[_GenerationTag, jinja2.ext.loopcontrols])
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace)


@functools.lru_cache(maxsize=MAX_COMPILED)
def _compiled(text: str) -> tuple[jinja2.Template | None, str | None]:
    """The template compiled, or why it does not compile (cached too: a broken template is parsed once)."""
    try:
        return _ENV.from_string(text), None
    except jinja2.TemplateSyntaxError as e:
        return None, f"syntax error at line {e.lineno}: {e.message}"


@functools.lru_cache(maxsize=MAX_COMPILED)
def _reads_tools(text: str) -> bool:
    if _compiled(text)[1] is not None:
        return False
    return "tools" in jinja2.meta.find_undeclared_variables(_ENV.parse(text))


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja2 chat template and where it came from (`source`: 'checkpoint', 'default', '--chat-template FILE' or
    '--chat-template', which error messages name)."""

    text: str
    source: str

    @property
    def problem(self) -> str | None:
        """Why the template does not compile, or None."""
        return _compiled(self.text)[1]

    @property
    def reads_tools(self) -> bool:
        """Whether the template reads `tools` at all: one that does not cannot tell the model about them."""
        return _reads_tools(self.text)

    def render(self, messages: object, *, add_generation_prompt: bool = True, tools: object = None,
               bos_token: str | None = None, eos_token: str | None = None) -> str:
        """The prompt for `messages` (OpenAI's: `role`, `content` as a string or text parts, and `name`,
        `tool_calls`, `tool_call_id` ... passed on as they are). Raises ValidationError for messages or tools that
        are not a conversation (naming the field), ChatTemplateError where the template fails."""
        context: dict[str, Any] = {"messages": check_messages(messages), "tools": _check_tools(tools),
                                   "add_generation_prompt": add_generation_prompt}
        context.update(special_tokens(bos_token=bos_token, eos_token=eos_token))
        template, problem = _compiled(self.text)
        if template is None:
            raise self._error(problem or "")
        try:
            return template.render(**context)
        except _Raised as e:
            raise self._error(f"the template raised: {e.message}") from None
        except jinja2.exceptions.SecurityError as e:
            raise self._error(f"refused by the sandbox: {e}") from None
        except jinja2.UndefinedError as e:
            raise self._error(f"undefined value: {e.message}") from None
        except Exception as e:  # anything a template's expression raises (TypeError, ZeroDivisionError, ...)
            raise self._error(f"{type(e).__name__}: {e}") from None

    def _error(self, reason: str) -> ChatTemplateError:
        if len(reason) > MAX_REASON_CHARS:
            reason = reason[: MAX_REASON_CHARS - 3] + "..."
        return ChatTemplateError("messages", f"the chat template ({self.source}) cannot render them: {reason}")


DEFAULT_TEMPLATE = ChatTemplate(DEFAULT_CHAT_TEMPLATE, DEFAULT)


def special_tokens(tokenizer: object = None, *, bos_token: str | None = None,
                   eos_token: str | None = None) -> dict[str, str]:
    """The `bos_token` / `eos_token` a template sees: those given, else the tokenizer's; one that is unset stays
    undefined in the template (renders as ''), as in transformers."""
    tokens = {"bos_token": bos_token or getattr(tokenizer, "bos_token", None),
              "eos_token": eos_token or getattr(tokenizer, "eos_token", None)}
    return {k: v for k, v in tokens.items() if isinstance(v, str)}


def load_chat_template(value: str | None) -> ChatTemplate | None:
    """`--chat-template FILE_OR_STRING` as vLLM reads it: the file's text if `value` names a file, else `value`
    itself is the template; a value that names no file and has none of `{`, `}` or a newline is a path that was
    mistyped, refused. Raises ValueError where it cannot be read or does not compile."""
    if value is None:
        return None
    path = Path(value)
    try:
        is_file = path.is_file()
    except (OSError, ValueError):  # a template's text too long or odd for a path
        is_file = False
    if is_file:
        try:
            template = ChatTemplate(path.read_text(encoding="utf-8"), f"{FLAG} {path}")
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"cannot read the chat template file {path}: {e}") from None
    elif not any(c in value for c in JINJA_CHARS):
        raise ValueError(f"no file {preview(value)} found, and it is no template either (no '{{', '}}' or newline)")
    else:
        template = ChatTemplate(value, FLAG)
    if template.problem is not None:
        raise ValueError(f"the chat template ({template.source}) does not compile: {template.problem}")
    return template


def resolve_chat_template(carried: str | None, fallback: ChatTemplate | None = None) -> ChatTemplate:
    """A model's template: the one its checkpoint carries, else `fallback` (--chat-template), else the default."""
    if carried is not None:
        return ChatTemplate(carried, CHECKPOINT)
    return fallback or DEFAULT_TEMPLATE


def check_messages(messages: object) -> list[dict[str, Any]]:
    """`messages` checked and copied as plain data for a template: a non-empty list of objects, each with a role
    of ROLES (or OpenAI's 'developer', which templates see as 'system') and a content (a string, or a list of text
    parts, joined by newlines; null or absent: ''), other keys as they are (plain JSON data)."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValidationError("messages", f"must be a non-empty list of messages, got {preview(messages)}")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise ValidationError(where, f"must be an object with a role and a content, got {preview(message)}")
        role = message.get("role")
        if role not in (*ROLES, "developer"):
            raise ValidationError(f"{where}.role", f"must be one of {', '.join(map(repr, ROLES))} or 'developer', "
                                                   f"got {preview(role)}")
        plain = _plain(message, where)
        if role == "developer":  # OpenAI's newer name for the system's instructions
            plain["role"] = "system"
        plain["content"] = _content(message.get("content"), f"{where}.content")
        out.append(plain)
    return out


def _content(content: object, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list | tuple):
        raise ValidationError(where, f"must be a string or a list of text parts, got {preview(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, Mapping):
            raise ValidationError(f"{where}[{j}]", f"must be a text part {{'type': 'text', 'text': ...}}, got "
                                                   f"{preview(part)}")
        if part.get("type") != "text":
            raise ValidationError(f"{where}[{j}].type", f"must be 'text' (only text parts are supported), got "
                                                        f"{preview(part.get('type'))}")
        if not isinstance(part.get("text"), str):
            raise ValidationError(f"{where}[{j}].text", f"must be a string, got {preview(part.get('text'))}")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_tools(tools: object) -> list[Any] | None:
    if tools is None:
        return None
    if not isinstance(tools, list | tuple):
        raise ValidationError("tools", f"must be a list of tools, got {preview(tools)}")
    for i, tool in enumerate(tools):
        if not isinstance(tool, Mapping):
            raise ValidationError(f"tools[{i}]", f"must be an object, got {preview(tool)}")
    return _plain(list(tools), "tools")


def _plain(value: Any, where: str) -> Any:
    """`value` rebuilt of JSON's types only (dict, list, str, int, float, bool, None): a template reaches no
    object's methods but those the sandbox allows on these. Anything else is a ValidationError naming its place."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        out = {}
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValidationError(where, f"keys must be strings, got {preview(k)}")
            out[str.__str__(k)] = _plain(v, f"{where}.{k}")
        return out
    if isinstance(value, list | tuple):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise ValidationError(where, f"must be JSON data, got a {type(value).__name__}")
