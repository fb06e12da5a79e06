"""Chunked prompts as apps send them (``chunkstore.prompts``): the separator "auto" picks,
how a chat and a text prompt split, and the documents a text separator breaks. The same
prompts through a real vLLM server: tests/connector/test_rag_apps.py and test_ingest.py."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from chunkstore.kv.keys import Isolation
from chunkstore.prompts import RagPrompts, default_separator, is_special, separator_ids

SYS = "Answer from the documents."
DOCS = ["Paris is the capital of France.", "The Danube flows through ten countries."]


@pytest.fixture(scope="module")
def smol(smollm2_dir):
    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_auto_picks_a_special_token_the_chat_template_does_not_use(smol, tiny_model_dir) -> None:
    assert default_separator(smol) == "<file_sep>" and is_special(smol, "<file_sep>")
    assert separator_ids(smol, "auto") == [5]
    # A template that writes the token itself rules it out.
    template = smol.chat_template
    try:
        smol.chat_template = template + "<file_sep>"
        assert default_separator(smol) == "##"
    finally:
        smol.chat_template = template
    tiny = AutoTokenizer.from_pretrained(tiny_model_dir)  # specials: unk, bos, eos only
    assert default_separator(tiny) == "##" and not is_special(tiny, "##")


def test_a_chat_request_splits_after_what_the_template_renders_before_the_first_separator(
    smol,
) -> None:
    prompts = RagPrompts(smol, SYS, chat=True)
    ids = prompts.token_ids(DOCS, "Which river?")
    rendered = smol.apply_chat_template(
        prompts.messages(DOCS, "Which river?"), tokenize=False, add_generation_prompt=True
    )
    assert rendered.startswith(f"<|im_start|>system\n{SYS}<|im_end|>\n<|im_start|>user\n")
    sys_seg, *chunks, question = prompts.segments(DOCS, "Which river?")
    assert smol.decode(sys_seg.token_ids) == rendered[: rendered.index("<file_sep>") + 10]
    assert [smol.decode(c.token_ids) for c in chunks] == [d + "<file_sep>" for d in DOCS]
    assert smol.decode(question.token_ids).startswith("Which river?<|im_end|>")
    assert question.end == len(ids)
    # vLLM started with --chat-template renders another sys segment: ingest follows it.
    plain = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant] "
    other = RagPrompts(smol, SYS, chat=True, chat_template=plain).segments(DOCS, "q")
    assert smol.decode(other[0].token_ids) == f"[system] {SYS}\n[user] <file_sep>"
    assert [c.token_ids for c in other[1:-1]] == [c.token_ids for c in chunks]
    # Without a system message the template's own one is the sys segment.
    bare = RagPrompts(smol, None, chat=True).segments(DOCS, "q")[0]
    assert "You are a helpful AI assistant named SmolLM" in smol.decode(bare.token_ids)


def test_keys_do_not_depend_on_the_shape_order_or_neighbours_only_on_sys(smollm2_dir) -> None:
    chat = RagPrompts.for_model(smollm2_dir, SYS, chat=True)
    text = RagPrompts.for_model(smollm2_dir, SYS)
    # In a request the chunk's key is the one ingest stores it under, in any order.
    for docs in (DOCS, DOCS[::-1]):
        segments = chat.segments(docs, "q")
        keys = chat.keys(segments)[1:-1]
        assert keys == chat.doc_keys(docs)
    # Chat and text have different sys segments, hence different chunk keys.
    assert set(chat.doc_keys(DOCS)).isdisjoint(text.doc_keys(DOCS))
    none = RagPrompts.for_model(smollm2_dir, SYS, isolation=Isolation.NONE, chat=True)
    other = RagPrompts.for_model(smollm2_dir, "Another sys.", isolation=Isolation.NONE, chat=True)
    assert none.doc_keys(DOCS) == other.doc_keys(DOCS)  # a chunk that sees only itself


def test_check_names_what_a_text_separator_breaks_and_a_special_token_does_not(
    smollm2_dir,
) -> None:
    text = RagPrompts.for_model(smollm2_dir, SYS, separator="##")
    special = RagPrompts.for_model(smollm2_dir, SYS)
    ends_in_hash, starts_with_hash = "It is written in C#", "#1 on the list"
    heading = "Intro\n## Details\nmore"  # the separator's own token inside the document
    assert "merges" in (text.check(ends_in_hash) or "")
    assert "merges" in (text.check(starts_with_hash) or "")
    assert "holds the separator" in (text.check(heading) or "")
    assert text.check(DOCS[0]) is None
    with pytest.raises(ValueError, match="where sys ends"):
        RagPrompts(text.tokenizer, "Written in C#", separator="##")  # sys merges with it
    assert text.ingest_prompt(ends_in_hash) is None
    for doc in (ends_in_hash, starts_with_hash, heading, *DOCS):
        assert special.check(doc) is None
        assert special.ingest_prompt(doc) is not None
