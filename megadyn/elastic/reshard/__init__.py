"""What moves in a change of layout: the training state's description, the reshard plan between
two descriptions, and the executor that moves the tensors."""
