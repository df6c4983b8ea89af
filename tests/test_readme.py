"""README's quickstart runs as written."""

from pathlib import Path


def test_quickstart_runs():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    code = readme.split("```python")[1].split("```")[0]
    exec(compile(code, "README.md", "exec"), {})


LONGEST_SENTENCE = 35  # words; README's median is about 16


def sentences(markdown: str) -> list[str]:
    """The prose sentences of a Markdown text: code blocks, indented blocks and tables left
    out, each list item a paragraph of its own, a bold title a sentence."""
    import re

    text = re.sub(r"```.*?```", "", markdown, flags=re.S)
    text = "\n".join(line for line in text.split("\n") if not line.startswith(("    ", "|")))
    text = re.sub(r"\n(?=[-*] |\d+\. |#)", "\n\n", text)
    return [s.strip() for para in text.split("\n\n")
            for s in re.split(r"(?:(?<=[.!?:;])|(?<=[.!?:;]\*\*))\s+(?=[A-Z`(*])",
                              para.replace("\n", " "))
            if s.strip()]


def test_readmes_sentences_are_short():
    """Issue 53: README's sentences as short as the rest of the docs."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    long = [s for s in sentences(readme) if len(s.split()) > LONGEST_SENTENCE]
    assert not long, long
    assert len(sentences("One two. Three: four.\n\n- **Five.** Six seven.\n- Eight.")) == 5
