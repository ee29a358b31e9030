"""amp_fx inside the trainers people use: `amp_fx.integrations.transformers` (Hugging Face
Trainer) and `amp_fx.integrations.lightning` (Lightning's Trainer and Fabric). Each is imported by
its own name, so importing amp_fx never imports a trainer library."""
