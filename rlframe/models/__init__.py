"""Facts about the model family read from its own config on the driver, and the checks of the
run against them."""
