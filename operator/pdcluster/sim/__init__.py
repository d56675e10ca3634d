"""Fleet simulator: traces replayed through the router policy and the control law (pdctl plan)."""
