"""Relevant documents last (``chunkstore.router.order``): the prompt the router sends a back
end without the in-band hook is the client's with the relevant documents moved just before
the question, token for token what the client would have sent in that order, in both
shapes; the application's own ranking and its wish to keep its order are honoured."""

from __future__ import annotations

from chunkstore.kv.keyspace import KeySpace
from chunkstore.kv.segments import reordered_ids
from chunkstore.policy.treatment import QualityConfig
from chunkstore.prompts import RagPrompts
from chunkstore.router import order

DOCS = [
    "Paris is the capital of France.",
    "The Danube flows through ten countries.",
    "Berlin is the capital of Germany.",
    "Mount Everest is the highest mountain on Earth.",
]
QUESTION = "Which river flows through ten countries?"  # the second document's


def test_a_completion_is_sent_with_its_relevant_document_last(tiny_model_dir) -> None:
    prompts = RagPrompts.for_model(tiny_model_dir, "Answer from the documents.")
    keys = KeySpace.for_model(tiny_model_dir, "float32")
    assert keys.separator == tuple(prompts.sep_ids) and keys.separator_text == prompts.sep_text
    ids = prompts.token_ids(DOCS, QUESTION)
    found = order.new_order(keys, QualityConfig(), ids)
    assert found is not None
    segments, chunk_order = found
    assert chunk_order[-1] == 2  # segment 2: the Danube's
    moved = [DOCS[i - 1] for i in chunk_order]
    sent = reordered_ids(segments, chunk_order)
    assert sent == prompts.token_ids(moved, QUESTION)  # what the client would have sent
    # There, it is computed by vLLM after the others load; in that order nothing moves.
    start = order.computed_from(keys, QualityConfig(), sent)
    assert start == prompts.segments(moved, QUESTION)[len(DOCS)].start
    assert order.new_order(keys, QualityConfig(), sent) is None
    # The application's scores rank (the first document here), and are sent renamed.
    params = {"chunk_scores": [9.0, 1.0, 0.0, 0.0]}
    scored = order.new_order(keys, QualityConfig(), ids, params)
    assert scored is not None and scored[1][-1] == 1
    renamed = order.reordered_params(params, scored[1])
    assert renamed["chunk_scores"][-1] == 9.0 and sorted(renamed["chunk_scores"]) == [0, 0, 1, 9]
    assert order.new_order(keys, QualityConfig(), reordered_ids(*scored), renamed) is None


def test_a_chat_message_is_rewritten_document_for_document(smollm2_dir) -> None:
    chat = RagPrompts.for_model(smollm2_dir, "Answer from the documents.", chat=True)
    keys = KeySpace.for_model(smollm2_dir, "float32")
    found = order.new_order(keys, QualityConfig(), chat.token_ids(DOCS, QUESTION))
    assert found is not None
    segments, chunk_order = found
    messages = order.chat_messages(
        chat.messages(DOCS, QUESTION), keys.separator_text, segments, chunk_order
    )
    moved = [DOCS[i - 1] for i in chunk_order]
    assert messages == chat.messages(moved, QUESTION)
    assert reordered_ids(segments, chunk_order) == chat.token_ids(moved, QUESTION)
    # Separators spread over two messages: the order stays.
    split = chat.messages(DOCS, QUESTION)
    split[0] = split[0] | {"content": split[0]["content"] + keys.separator_text}
    assert order.chat_messages(split, keys.separator_text, segments, chunk_order) is None


def test_an_application_keeps_its_order_by_asking() -> None:
    def keeps(body: dict, prompts: int) -> bool:
        return order.keeps_order(order.params_of(body), prompts)

    assert keeps({"kv_transfer_params": {"keep_order": True}}, 1)
    assert not keeps({"kv_transfer_params": {"chunk_scores": [1, 2]}}, 1)
    # Chunks named by place for several prompts at once: one order cannot serve them all.
    assert keeps({"kv_transfer_params": {"recompute_chunks": [0]}}, 2)
    assert not keeps({}, 3)
