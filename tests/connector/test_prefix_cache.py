"""The prefix-cache rule of in-band isolation, on vLLM's own Request and block hasher: blocks
that hold question (or generated) tokens get their own hashes, so vLLM's prefix cache only
shares a block between prompts whose tokens in it have the same roles."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from chunkstore.kv.segments import SegmentKind, split_prompt
from chunkstore_vllm.prefix_cache import keep_roles_apart

BLOCK = 4
SEP = [9, 9]
SYS, C1 = [1, 2, 3, 4, 5] + SEP, [11, 12, 13, 14, 15] + SEP  # sys ends at 7, c1 at 14
X = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30]  # 14..24
Y = [31, 32, 33]


def request(tokens: list[int], name: str = "r") -> Request:
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    return Request(
        name,
        list(tokens),
        SamplingParams(max_tokens=8),
        None,
        block_hasher=get_request_block_hasher(BLOCK, hash_fn),
    )


def role_aware(tokens: list[int], name: str = "r") -> Request:
    req = request(tokens, name)
    segments = split_prompt(tokens, SEP)
    last = segments[-1]
    question_start = last.start if last.kind is SegmentKind.QUESTION else last.end
    assert keep_roles_apart(req, question_start, BLOCK)
    return req


def test_blocks_of_question_tokens_are_not_shared_with_the_same_tokens_as_a_chunk() -> None:
    asked = role_aware(SYS + C1 + X)  # X is the question: it sees c1
    chunk = role_aware(SYS + C1 + X + SEP + Y)  # X is a chunk: it must not
    plain = request(SYS + C1 + X + SEP + Y)
    # Blocks before X's first token (sys, c1) are vLLM's own hashes and shared.
    first_x_block = len(SYS + C1) // BLOCK  # 3: positions 12..15 hold c1's end and X's start
    assert asked.block_hashes[:first_x_block] == plain.block_hashes[:first_x_block]
    first_y_block = len(SYS + C1 + X + SEP) // BLOCK  # 6: holds Y's first tokens
    assert chunk.block_hashes[:first_y_block] == plain.block_hashes[:first_y_block]
    assert chunk.block_hashes[first_y_block] != plain.block_hashes[first_y_block]
    for i in range(first_x_block, len(asked.block_hashes)):
        assert asked.block_hashes[i] != chunk.block_hashes[i]
        assert asked.block_hashes[i] not in plain.block_hashes


def test_the_same_question_and_a_chat_that_appends_to_it_share_blocks() -> None:
    turn1 = role_aware(SYS + C1 + X, "turn1")
    again = role_aware(SYS + C1 + X, "again")
    assert again.block_hashes == turn1.block_hashes
    answer = [41, 42, 43, 44, 45, 46]
    for token in answer:  # generated one at a time: hashes as the request grows
        turn1.append_output_token_ids(token)
    turn2 = role_aware(SYS + C1 + X + answer + [51, 52, 53], "turn2")  # hashed at once
    assert turn2.block_hashes[: len(turn1.block_hashes)] == turn1.block_hashes


def test_generated_tokens_of_a_prompt_without_question_are_question_tokens() -> None:
    ingest = role_aware(SYS + C1 + X + SEP, "ingest")  # ends with a separator
    chunked = request(SYS + C1 + X + SEP + Y + [61, 62, 63] + SEP, "chunked")
    shared = len(ingest.block_hashes)
    assert ingest.block_hashes == chunked.block_hashes[:shared]
    for token in Y + [61]:  # what it generates fills a block after the separator
        ingest.append_output_token_ids(token)
    assert len(ingest.block_hashes) > shared
    assert ingest.block_hashes[shared] != chunked.block_hashes[shared]


def test_a_request_without_a_hasher_is_left_alone() -> None:
    req = Request("r", SYS + C1 + X, SamplingParams(max_tokens=1), None)
    assert not keep_roles_apart(req, len(SYS + C1), BLOCK)


def test_with_recompute_tokens_blocks_holding_chunk_tokens_are_private() -> None:
    """``recompute_tokens`` leaves the blend in chunk blocks: two requests with the same
    prompt share only the blocks that hold sys tokens alone, also as they grow."""
    tokens = SYS + C1 + X + SEP + Y
    private_from = len(SYS)  # 7: block 1 (positions 4..7) holds sys's end and c1's start
    first, second = request(tokens, "a"), request(tokens, "b")
    assert keep_roles_apart(first, len(tokens), BLOCK, private_from)
    assert keep_roles_apart(second, len(tokens), BLOCK, private_from)
    plain = request(tokens)
    assert first.block_hashes[:1] == second.block_hashes[:1] == plain.block_hashes[:1]
    for i in range(1, len(first.block_hashes)):
        assert first.block_hashes[i] != second.block_hashes[i]
        assert first.block_hashes[i] not in plain.block_hashes
    before = len(first.block_hashes)
    for token in [41, 42, 43, 44]:
        first.append_output_token_ids(token)
        second.append_output_token_ids(token)
    assert len(first.block_hashes) == before + 1
    assert first.block_hashes[-1] != second.block_hashes[-1]
