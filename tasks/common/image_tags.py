"""Where a prompt puts its images (issue 54): an `<image>` tag in text, or a {"type": "image"} block in a chat
message's content (OpenAI's and HF's form). Standard library only: prepare_data checks rows with it and the stages
encode prompts with it (tasks/common/nn/vision.py), so both count the same way.

    count_placeholders("<image>colour?")                                                    # 1
    count_placeholders([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "and <image>"}]}])  # 2
    content_text([{"type": "image"}, {"type": "text", "text": "colour?"}])                 # "<image>colour?"
"""

from __future__ import annotations

IMAGE_TAG = "<image>"


def content_text(content) -> str:
    """A message's content as text: a string itself; content blocks with each image block as an `<image>` tag."""
    if isinstance(content, str):
        return content
    return "".join(IMAGE_TAG if b.get("type") == "image" else b.get("text", "") for b in content)


def is_content_blocks(content) -> bool:
    """Whether message content is a non-empty list of text blocks ({"type": "text", "text": str}) and image blocks."""
    return (
        isinstance(content, list)
        and bool(content)
        and all(
            isinstance(b, dict)
            and (b.get("type") == "image" or (b.get("type") == "text" and isinstance(b.get("text"), str)))
            for b in content
        )
    )


def count_placeholders(prompt) -> int:
    """Images a prompt asks for: `<image>` tags in its text (or its messages' text) and image blocks."""
    if isinstance(prompt, str):
        return prompt.count(IMAGE_TAG)
    return sum(content_text(m["content"]).count(IMAGE_TAG) for m in prompt)
