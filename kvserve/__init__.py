"""kvserve: serve and evaluate open-weight decoder LLMs. The CLI composes the components."""
