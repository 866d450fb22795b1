"""Prompt templates against real Hugging Face tokenizers built offline (no downloads)."""
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from megadiv.data import INSTRUCTIONS, DataConfig, PromptTemplate, char_tokenizer, load_dataset

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def byte_level_bpe(chat_template=None) -> PreTrainedTokenizerFast:
    """A small byte-level BPE trained here on dataset text, ChatML specials, a BOS post-processor."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [r.prompt for r in load_dataset(DataConfig(name="gsm8k", split="test", max_items=200))]
    specials = ["<|bos|>", "<|im_start|>", "<|im_end|>"]
    tok.train_from_iterator(corpus + list(INSTRUCTIONS.values()), trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|im_end|>",
                                   chat_template=chat_template)


@pytest.fixture(scope="module")
def gsm8k():
    return load_dataset(DataConfig(name="gsm8k", split="test", max_items=3))


def test_auto_uses_the_chat_template_when_there_is_one(gsm8k):
    tok = byte_level_bpe(CHATML)
    tpl = PromptTemplate.resolve(DataConfig(name="gsm8k", system_prompt="You are careful."), gsm8k, tok)
    assert tpl.kind == "chat" and tpl.answer_format == "hash"
    text = tpl.text(gsm8k[0], tok)
    assert text == (f"<|im_start|>system\nYou are careful.<|im_end|>\n<|im_start|>user\n{gsm8k[0].prompt}\n\n"
                    f"{INSTRUCTIONS['hash']}<|im_end|>\n<|im_start|>assistant\n")
    ids = tpl.token_ids(gsm8k[0], tok)
    # The rendered template carries its own special tokens: no extra BOS, and they are single tokens.
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>") and tok.bos_token_id not in ids
    assert tok.decode(ids) == text


def test_plain_template_without_chat_template(gsm8k):
    tok = byte_level_bpe()
    tpl = PromptTemplate.resolve(DataConfig(name="gsm8k", answer_format="boxed"), gsm8k, tok)
    assert tpl.kind == "plain" and tpl.answer_format == "boxed"
    text = tpl.text(gsm8k[1], tok)
    assert text.startswith("Question: " + gsm8k[1].prompt) and text.endswith(INSTRUCTIONS["boxed"] + "\nAnswer:")
    assert "\\boxed{}" in text
    ids = tpl.token_ids(gsm8k[1], tok)
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == text  # plain prompts get the usual BOS
    with pytest.raises(ValueError, match="no chat_template"):
        PromptTemplate.resolve(DataConfig(name="gsm8k", template="chat"), gsm8k, tok)


def test_code_prompts_list_the_tests_and_the_format():
    mbpp = load_dataset(DataConfig(name="mbpp", split="test", max_items=1))
    text = PromptTemplate.resolve(DataConfig(name="mbpp", template="plain"), mbpp).text(mbpp[0])
    assert mbpp[0].prompt in text and all(t in text for t in mbpp[0].tests) and "```python" in text


def test_raw_template_for_the_arithmetic_task():
    ds = load_dataset(DataConfig(name="arithmetic", split="test", max_items=2))
    tok = char_tokenizer()
    tpl = PromptTemplate.resolve(DataConfig(name="arithmetic", template="raw"), ds, tok)
    assert tpl.text(ds[0]) == ds[0].prompt and ds[0].prompt.endswith("=")
    assert tok.decode(tpl.token_ids(ds[0], tok)) == ds[0].prompt


# A Qwen3-like template: a thinking switch read from enable_thinking (default on).
THINKING = CHATML.replace("<|im_start|>assistant\n{% endif %}",
                          "<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
                          "<think>\n\n</think>\n\n{% endif %}{% endif %}")


def test_enable_thinking_reaches_templates_that_take_it(gsm8k):
    tok = byte_level_bpe(THINKING)
    default = PromptTemplate.resolve(DataConfig(name="gsm8k"), gsm8k, tok).text(gsm8k[0], tok)
    off = PromptTemplate.resolve(DataConfig(name="gsm8k", enable_thinking=False), gsm8k, tok).text(gsm8k[0], tok)
    on = PromptTemplate.resolve(DataConfig(name="gsm8k", enable_thinking=True), gsm8k, tok).text(gsm8k[0], tok)
    assert off == default + "<think>\n\n</think>\n\n" and on == default
    # a template without a thinking mode: false is accepted (nothing to turn off), true is refused
    plain_chat = byte_level_bpe(CHATML)
    assert (PromptTemplate.resolve(DataConfig(name="gsm8k", enable_thinking=False), gsm8k, plain_chat)
            .text(gsm8k[0], plain_chat) == PromptTemplate.resolve(DataConfig(name="gsm8k"), gsm8k, plain_chat)
            .text(gsm8k[0], plain_chat))
    with pytest.raises(ValueError, match="no thinking mode"):
        PromptTemplate.resolve(DataConfig(name="gsm8k", enable_thinking=True), gsm8k, plain_chat)


def test_gbmpo_prompts_are_the_authors(gsm8k):
    tok = byte_level_bpe(CHATML)
    text = PromptTemplate.resolve(DataConfig(name="gsm8k", prompt_style="gbmpo_train"), gsm8k, tok).text(gsm8k[0], tok)
    assert text == ("<|im_start|>system\nYou are a careful math tutor. Solve step by step and provide the final "
                    f"numeric answer.<|im_end|>\n<|im_start|>user\nProblem:\n{gsm8k[0].prompt}<|im_end|>\n"
                    "<|im_start|>assistant\n")
    plain = PromptTemplate.resolve(DataConfig(name="gsm8k", template="plain", prompt_style="gbmpo_eval"), gsm8k)
    assert plain.text(gsm8k[0]) == ("You are a careful math tutor. Solve step by step and provide the final numeric "
                                    f"answer.\n\nProblem:\n{gsm8k[0].prompt}\n\nAnswer:")
    mbpp = load_dataset(DataConfig(name="mbpp", split="test", max_items=2))  # task 11: def remove_Occ(s,ch)
    train = PromptTemplate.resolve(DataConfig(name="mbpp", prompt_style="gbmpo_train"), mbpp, tok).text(mbpp[0], tok)
    assert train.startswith(f"<|im_start|>user\n{mbpp[0].prompt}\n\nIMPLEMENT EXACTLY THIS FUNCTION:\n\n"
                            "def remove_Occ(s, ch):\n    # Your implementation here\n\nREQUIREMENTS:\n"
                            "- Use ONLY this function name: remove_Occ\n- Accept exactly these parameters: s, ch\n")
    assert "system" not in train and train.endswith("No markdown, no explanations, no examples<|im_end|>\n"
                                                    "<|im_start|>assistant\n")
    evaluation = PromptTemplate.resolve(DataConfig(name="mbpp", prompt_style="gbmpo_eval"), mbpp, tok).text(mbpp[1], tok)
    assert evaluation.startswith("<|im_start|>system\nYou are a helpful Python coding assistant. Output ONLY the "
                                 "final code solution.\n")
    assert (f"<|im_start|>user\n{mbpp[1].prompt}\n\nYour code should pass these tests:\n" + "\n".join(mbpp[1].tests)
            + "<|im_end|>") in evaluation
    with pytest.raises(ValueError, match="system_prompt"):
        DataConfig(name="gsm8k", prompt_style="gbmpo_eval", system_prompt="x")


def test_tested_function_reads_name_and_arity_like_the_authors():
    from megadiv.data.templates import tested_function

    assert tested_function('assert remove_Occ("hello","l") == "heo"') == ("remove_Occ", 2)
    assert tested_function("assert f([1, 2], (3, 4), 'a') == 1") == ("f", 2)  # up to the first ')'
    assert tested_function("assert g() == 0") == ("g", 0)
    assert tested_function("x = 1") == (None, 0)
