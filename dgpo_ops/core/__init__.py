"""The loss's options, inputs, checks, objective and outputs, shared by every op and layout."""
