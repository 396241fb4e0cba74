"""Kind-specific payload codecs: what the tensors of a result message mean and how they are checked."""
