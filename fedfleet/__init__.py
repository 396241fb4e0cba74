"""fedfleet: the command dispatcher and the emulated fleet, the only layer that starts both sides."""
