"""LogPlayer: TargetQueue and Dispatcher, targets, end to end, the spin model."""
