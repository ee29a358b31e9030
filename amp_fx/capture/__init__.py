"""The parts of the torch.export front end's capture that `amp_fx.captured_model` puts together:
the state kept on captured modules (`state`), whether a graph fits a call (`fit`) and gradient
checkpointing around a capture (`checkpointing`)."""
