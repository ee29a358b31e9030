"""The parts of the torch.export front end's capture that `amp_fx.capture.captured_model` puts together:
the state kept on captured modules (`state`), whether a graph fits a call (`fit`), gradient
checkpointing around a capture (`checkpointing`) and where parameters are stored (`storage`)."""
