"""One launch on the driver: the checks before Ray, Ray, the pools and groups, the loop's
parts, the teardown."""
