"""Apex quickstart: the classic "train in half precision with Apex.amp" program, run by amp_fx.

It is Apex's documented recipe unchanged except for what it needs to run anywhere: the import
(``from amp_fx import amp`` instead of ``from apex import amp``), the device (``.to(device)``
instead of ``.cuda()``, so it runs on a CPU too), and a synthetic ``dataloader`` and
``num_epochs``. As in the original it calls ``optimizer.step()`` inside the ``scale_loss`` block;
amp_fx unscales that loss's gradients before stepping, so this works (with Apex it silently
stepped on stale grads).

    python examples/apex_quickstart.py [--epochs 2] [--checkpoint model.pth]
"""

import argparse
import logging
import sys

import torch
import torch.nn as nn

from amp_fx import amp  # was: from apex import amp


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()  # noqa: UP008  (Apex's examples' spelling)
        self.fc1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(10, 2)

    def forward(self, x):
        x = self.fc1(x)
        x = self.relu(x)
        x = self.fc2(x)
        return x


def synthetic_dataloader(batches=20, batch_size=32, seed=0):
    """Stand-in for the quickstart's undefined `dataloader`: the label says whether the features sum > 0."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(batches):
        inputs = torch.randn(batch_size, 10, generator=generator)
        data.append((inputs, (inputs.sum(dim=1) > 0).long()))
    return data


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--checkpoint", default="model.pth", help="where the seed saves the model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # amp's messages, as Apex printed them
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    num_epochs = args.epochs
    dataloader = synthetic_dataloader()

    # 3. Define the model
    model = Net().to(device)

    # 4. Define the loss and the optimizer
    criterion = nn.CrossEntropyLoss()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    # 5. Put the model and the optimizer into amp for mixed-precision training
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2")

    # 6. Train
    for epoch in range(num_epochs):
        for inputs, labels in dataloader:
            inputs = inputs.to(device)
            labels = labels.to(device)

            # forward
            outputs = model(inputs)
            loss = criterion(outputs, labels)

            # backward and update
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
                optimizer.step()
        print(f"epoch {epoch + 1}/{num_epochs}: loss {loss.item():.4f}")

    # 7. Save and load the model
    torch.save(model.state_dict(), args.checkpoint)

    model = Net()
    model.load_state_dict(torch.load(args.checkpoint))
    model.to(device)

    # The reloaded FP32 Net reproduces the trained model's accuracy.
    correct = total = 0
    with torch.no_grad():
        for inputs, labels in dataloader:
            predicted = model(inputs.to(device)).argmax(dim=1)
            correct += (predicted == labels.to(device)).sum().item()
            total += labels.numel()
    accuracy = 100.0 * correct / total
    print(f"reloaded FP32 model from {args.checkpoint}: accuracy {accuracy:.1f}%")
    return accuracy


if __name__ == "__main__":
    main(sys.argv[1:])
