"""The text plait appends between two model turns, and the check that appending it is what the
chat template would render for the whole conversation.

A multi-turn rollout is token-in, token-out: the model's tokens are kept as sampled and the
tool turn's text is tokenized on its own and appended. That equals what a chat stack would
feed the model for the same conversation only if the template renders a conversation by
appending: the rendering of the first k messages must be a prefix of the rendering of all of
them, and the pieces, tokenized apart, must give the tokens of the whole. Templates that
rewrite earlier turns (dropping an earlier turn's reasoning, say) fail that, and a run on them
would train on contexts the model never sees at inference (verl #6501, TRL #5224): plait
refuses them, naming the turn where the renderings part.
"""

from __future__ import annotations

from plait.programs.calls import tool_schemas


SENTINEL = "PLAIT-TURN-7f3a9c"  # stands in for the model's text while rendering the turn after it


class TemplateMismatch(ValueError):
    """The chat template does not render a conversation by appending."""


class ChatTurns:
    """Renders tool turns with the tokenizer's chat template (or `template`, a Jinja string),
    describing `tools` (JSON schemas) where the template can."""

    def __init__(self, tokenizer, template: str | None = None, tools: list[dict] | None = None, role: str = "tool"):
        self.tokenizer = tokenizer
        self.kwargs = {"chat_template": template} if template else {}
        if tools:
            self.kwargs["tools"] = tools
        self.role = role

    def with_tools(self, tools: list[dict] | None) -> ChatTurns:
        """The same template describing other tools (a trl_env row's own)."""
        return ChatTurns(self.tokenizer, self.kwargs.get("chat_template"), tools, self.role)

    def describes_tools(self, messages: list[dict]) -> bool:
        """Does the template show the tools' schemas to the model (many small models' templates don't)?"""
        if "tools" not in self.kwargs:
            return True
        return self.render(messages, True) != self.with_tools(None).render(messages, True)

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False, **self.kwargs
        )

    def after_turn(self, history: list[dict], history_text: str, tool_messages: list[dict]) -> str:
        """The text after an assistant turn that ends in a tool call: the end of that turn, the
        tool messages and the header of the next assistant turn. `history` is the conversation
        up to that assistant turn and `history_text` what the model was given for it (the
        prompt and every piece since); TemplateMismatch when the template renders them apart."""
        return self._suffix(history, history_text, tool_messages, generation_prompt=True)

    def end_of_turn(self, history: list[dict], history_text: str) -> str:
        """The text that closes the last assistant turn of a finished conversation."""
        return self._suffix(history, history_text, [], generation_prompt=False)

    def _suffix(self, history, history_text, tool_messages, generation_prompt) -> str:
        rendered = self.render(
            [*history, {"role": "assistant", "content": SENTINEL}, *tool_messages], generation_prompt
        )
        before, found, after = rendered.partition(SENTINEL)
        if not found:
            raise TemplateMismatch("the chat template drops the assistant's text")
        if before != history_text:
            at = next(
                (i for i, (a, b) in enumerate(zip(before, history_text)) if a != b), min(len(before), len(history_text))
            )
            raise TemplateMismatch(
                f"the chat template renders the conversation before assistant turn {_turns(history) + 1} differently "
                f"once the conversation goes on: at character {at} it gives {before[at : at + 60]!r} where the model "
                f"was given {history_text[at : at + 60]!r}"
            )
        return after


def _turns(history: list[dict]) -> int:
    return sum(m.get("role") == "assistant" for m in history)


def check_template(turns: ChatTurns, prompt_messages: list[dict], prompt_text: str, turn_texts: list[str]) -> None:
    """Play a conversation (`turn_texts`: assistant turns, each but the last followed by a tool
    answer) the way a rollout builds it, piece by piece, and compare with the template's
    rendering of the whole: as text, and as tokens. TemplateMismatch says where they part."""
    tok = turns.tokenizer
    history, text = list(prompt_messages), prompt_text
    pieces = [prompt_text]
    for i, content in enumerate(turn_texts):
        last = i == len(turn_texts) - 1
        tool = [] if last else [{"role": turns.role, "content": f"{6 * (i + 7)}"}]
        after = turns.end_of_turn(history, text) if last else turns.after_turn(history, text, tool)
        history += [{"role": "assistant", "content": content}, *tool]
        text += content + after
        pieces += [content, after]
    whole = turns.render(history, generation_prompt=False)
    if whole != text:
        raise TemplateMismatch("the chat template renders the whole conversation differently from its turns appended")
    ids = [i for piece in pieces for i in tok(piece, add_special_tokens=False)["input_ids"]]
    expected = tok(whole, add_special_tokens=False)["input_ids"]
    if ids != expected:
        at = next((i for i, (a, b) in enumerate(zip(ids, expected)) if a != b), min(len(ids), len(expected)))
        raise TemplateMismatch(
            "the turns tokenized apart give other tokens than the whole conversation tokenized at once "
            f"(from token {at}: {tok.convert_ids_to_tokens(ids[at : at + 4])} vs "
            f"{tok.convert_ids_to_tokens(expected[at : at + 4])}): a turn boundary falls inside a token"
        )


def chat_turns(cfg, tokenizer) -> ChatTurns | None:
    """Tool turns rendered by the run's chat template; None when prompts are plain text."""
    own = cfg.data.chat_template if isinstance(cfg.data.chat_template, str) else None
    if not cfg.data.chat_template or not (own or tokenizer.chat_template):
        return None
    return ChatTurns(tokenizer, own, tool_schemas(cfg.rollout.tools), cfg.rollout.tools.role)
