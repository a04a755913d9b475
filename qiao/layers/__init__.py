"""Building blocks of the models: linear layers, norms, rotary embedding, attention."""
