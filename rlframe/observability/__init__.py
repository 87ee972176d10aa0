"""What a person sees of a run: log routing, the console's summary, metric sinks, the start-up
clock."""
