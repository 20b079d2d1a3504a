"""OpenAI-format chat messages (issue 37), as OpenAI-compatible clients and ``transformers serve`` send them: tool
call ``arguments`` as a JSON string, ``content: None`` beside ``tool_calls``, and content as a list of text parts.
Each renders exactly as the plain form (arguments as a mapping, empty content, the joined string) does, through the
tokenizer alone (as TRL and serve call it) and through the processor."""

from __future__ import annotations

import json

import pytest
from jinja2.exceptions import TemplateError
from transformers import PreTrainedTokenizerFast
from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

from glm53flash_hf.processing_glm53flash import Glm53FlashProcessor, Glm53FlashVideoProcessor, load_chat_template

CALL = ("<tool_call>get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key><arg_value>2</arg_value></tool_call>")


@pytest.fixture(scope="module")
def tokenizer():
    from glm53flash_hf.tools.make_tiny import train_tokenizer

    return PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(2000), eos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", clean_up_tokenization_spaces=False)


@pytest.fixture(scope="module")
def processor(tokenizer):
    return Glm53FlashProcessor(Glm5NextImageProcessorPil(), tokenizer, Glm53FlashVideoProcessor())


def by_tokenizer(tokenizer, messages, **kwargs):
    return tokenizer.apply_chat_template(messages, chat_template=load_chat_template(), tokenize=False, **kwargs)


def by_processor(processor, messages, **kwargs):
    return processor.apply_chat_template(messages, tokenize=False, **kwargs)


RENDERERS = {"tokenizer": lambda t, p: (t, by_tokenizer), "processor": lambda t, p: (p, by_processor)}


@pytest.fixture(params=sorted(RENDERERS))
def rendered(request, tokenizer, processor):
    """``rendered(messages, **kwargs)``: the template's text, through the tokenizer or through the processor."""
    owner, render = RENDERERS[request.param](tokenizer, processor)
    return lambda messages, **kwargs: render(owner, messages, **kwargs)


def tool_chat(arguments, content=None):
    """A user question, an OpenAI-format assistant tool call with ``arguments`` and its tool result."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": content, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22C"},
    ]


# ------------------------------------------------------------------------------------------------ JSON string arguments


def test_json_string_arguments_render_as_the_mapping(rendered):
    as_string = rendered(tool_chat('{"city": "Paris", "days": 2}'))
    assert as_string == rendered(tool_chat({"city": "Paris", "days": 2}))
    assert "<|assistant|><think></think>" + CALL + "<|observation|><tool_response>22C</tool_response>" in as_string


NESTED = {
    "city": "Zürich \"old town\"\n\t/ \\ 😀",
    "days": 2,
    "ratio": 0.25,
    "big": 12345678901234567890,
    "exp": 1e300,
    "neg_zero": -0.0,
    "ok": True,
    "none": None,
    "units": ["c", "f", 1.5, [], {}],
    "opts": {"lang": "fr", "nested": {"ü": ["\u0001", False]}, "empty": ""},
    "": "empty key",
}


@pytest.mark.parametrize("dump", [
    {}, {"ensure_ascii": False}, {"indent": 2}, {"separators": (",", ":")}, {"sort_keys": True},
], ids=["ascii", "unicode", "indent", "compact", "sorted"])
def test_json_string_arguments_of_every_kind_render_as_the_mapping(rendered, dump):
    """Escapes (\\uXXXX from Python's default ensure_ascii, surrogate pairs among them), nested objects and arrays,
    numbers in every form and any whitespace render exactly as the parsed mapping does."""
    text = json.dumps(NESTED, **dump)
    assert rendered(tool_chat(text)) == rendered(tool_chat(json.loads(text)))


@pytest.mark.parametrize("number", ["1.50", "1E5", "2.5e-3", "-0", "1e400", "-1e400", "0e0", "NaN", "-Infinity"])
def test_json_string_numbers_render_as_parsed(rendered, number):
    """A number renders as tojson writes the value json.loads reads from it (1.50 -> 1.5, 1E5 -> 100000.0)."""
    text = f'{{"x": {number}, "y": [{number}]}}'
    assert rendered(tool_chat(text)) == rendered(tool_chat(json.loads(text)))


def test_json_string_escapes_decode_as_json_loads_does(tokenizer):
    text = r'{"a": "\ud83d\ude00 \ud83d x\u00e9\/\b\f", "b": "\"q\""}'
    out = by_tokenizer(tokenizer, tool_chat(text))
    assert out == by_tokenizer(tokenizer, tool_chat(json.loads(text)))
    assert "<arg_key>a</arg_key><arg_value>😀 \ud83d xé/\b\f</arg_value><arg_key>b</arg_key><arg_value>\"q\"" in out


def test_json_string_arguments_in_sft_masks(processor):
    """The generation blocks (the assistant mask SFT trains on) are the same for either form."""
    masks = [processor.apply_chat_template(tool_chat(args), tokenize=True, return_dict=True,
                                           return_assistant_tokens_mask=True)
             for args in ('{"city": "Paris", "days": 2}', {"city": "Paris", "days": 2})]
    assert masks[0]["input_ids"] == masks[1]["input_ids"]
    assert masks[0]["assistant_masks"] == masks[1]["assistant_masks"] and 1 in masks[0]["assistant_masks"][0]


@pytest.mark.parametrize("text, reason", [
    ('{"city": "Paris",}', "a key in double quotes was expected at character 17"),
    ("{'city': 'Paris'}", "a key in double quotes was expected at character 1"),
    ('["Paris"]', "it does not start with {"),
    ('"Paris"', "it does not start with {"),
    ("", "it ends early"),
    ('{"city": "Paris"', "it ends early"),
    ('{"city": "Paris"} x', "more text follows the object"),
    ('{"days": 02}', "the number 02 is not valid JSON"),
    ('{"ok": True}', "True is not a JSON value"),
    ('{"city": "Par\\is"}', "the escape \\i is not valid"),
    ('{"city": "\\u00g9"}', "a \\u escape needs four hex digits"),
    ('{"city": "a\nb"}', "a string holds a raw control character"),
    ('{"city": "Paris", "city": "Lyon"}', 'the key "city" repeats'),
])
def test_bad_json_string_arguments_raise_naming_the_call_and_the_text(rendered, text, reason):
    prefix = 'tool call 0 ("get_weather"): arguments given as a string must be one JSON object, but '
    with pytest.raises(TemplateError) as caught:
        rendered(tool_chat(text))
    message = str(caught.value)
    assert message.startswith(prefix + reason), message
    assert message.endswith(" of " + json.dumps(text)), message


def test_bad_json_string_names_which_call(tokenizer):
    calls = [{"function": {"name": "first", "arguments": "{}"}}, {"function": {"name": "second", "arguments": "{"}}]
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "tool_calls": calls}]
    with pytest.raises(TemplateError, match=r'^tool call 1 \("second"\): .* of "\{"$'):
        by_tokenizer(tokenizer, messages)


def test_arguments_neither_mapping_nor_string_raise(tokenizer):
    with pytest.raises(TemplateError, match="tool call arguments must be a mapping .* or a JSON object string, got: "
                                            r"\[1, 2\]"):
        by_tokenizer(tokenizer, tool_chat([1, 2]))


# ------------------------------------------------------------------------------------------------ content None


def test_content_none_beside_tool_calls_renders_empty(rendered):
    with_none = rendered(tool_chat('{"city": "Paris", "days": 2}', content=None))
    assert with_none == rendered(tool_chat({"city": "Paris", "days": 2}, content=""))
    assert "None" not in with_none and "<|assistant|><think></think>" + CALL in with_none


def test_content_none_renders_empty_in_the_bare_template():
    """Rendered straight from the template (no transformers normalisation dropping ``None`` values first), ``None``
    content is still empty text, for every role."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    template = _compile_jinja_template(load_chat_template())
    call = {"function": {"name": "f", "arguments": '{"a": 1}'}}
    messages = [{"role": role, "content": None} for role in ("system", "user")] + [
        {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "content": None}]
    text = template.render(messages=messages)
    assert "None" not in text
    assert text.endswith("<|system|><|user|><|assistant|><think></think><tool_call>f<arg_key>a</arg_key>"
                         "<arg_value>1</arg_value></tool_call><|observation|><tool_response></tool_response>")


# ------------------------------------------------------------------------------------------------ list-of-parts content


def parts(*texts):
    return [{"type": "text", "text": text} for text in texts]


@pytest.mark.parametrize("role", ["system", "user", "assistant", "tool"])
def test_text_parts_render_as_the_joined_string(rendered, role):
    """Text parts render as their texts joined with nothing between, as the GLM reference template does."""
    def chat(content):
        before = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]
        last = {"role": role, "content": content}
        if role == "tool":
            last["tool_call_id"] = "call_1"
        return (before if role == "tool" else []) + [last]

    joined = rendered(chat("Hello, world. Bye."))
    assert rendered(chat(parts("Hello, ", "world.", " Bye."))) == joined
    assert rendered(chat(parts("Hello, world. Bye."))) == joined
    assert "Hello, world. Bye." in joined


def test_assistant_text_parts_split_inline_reasoning_as_the_string(rendered):
    """Reasoning written inline in an assistant turn's parts is split off as it is from the joined string."""
    string = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "<think>Why.</think>Answer."}]
    listed = [string[0], {"role": "assistant", "content": parts("<think>Why.", "</think>", "Answer.")}]
    assert rendered(listed) == rendered(string)
    assert rendered(listed).endswith("<|assistant|><think>Why.</think>Answer.<|endoftext|>")


def test_image_parts_beside_text_parts_keep_their_placeholders(processor):
    messages = [{"role": "user", "content": [{"type": "image"}, *parts("Describe ", "it.")]}]
    assert by_processor(processor, messages) == (
        "[gMASK]<sop><|system|>Reasoning Effort: Max<|user|><|begin_of_image|><|image|><|end_of_image|>Describe it."
    )
