"""The model platform: a versioned model repository, its control loop, routing and canary
weights, and the served model versions (LLM engines, encoders behind dynamic batchers)."""
