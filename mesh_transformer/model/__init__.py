"""The math of GPT-J: layers as pure functions, the param tree described once, forward and loss. Knows no mesh."""
