"""An OpenAI-compatible endpoint in front of the rollout (``rollout.agent=openai``): agents
written against the ``openai`` client train unchanged. :mod:`.app` serves the API,
:mod:`.sessions` keys episodes, :mod:`.batching` gathers calls into engine batches,
:mod:`.trajectory` turns calls into training rows, :mod:`.agent` runs the episodes."""
