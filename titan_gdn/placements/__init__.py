"""Where a mixer's heads and sequence live, as its forward calls them: head sharding, state
passing and their collectives. Set up on a model by `titan_gdn.parallel`."""
