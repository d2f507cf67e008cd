"""Human-readable class names, by dataset, in label order: what a served model's output indices mean."""

from __future__ import annotations

_DIGITS = tuple(str(i) for i in range(10))

CLASS_NAMES: dict[str, tuple[str, ...]] = {
    "mnist": _DIGITS,
    "emnist": _DIGITS,  # the EMNIST *digits* split, which is what this project loads
    "fmnist": ("T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag",
               "Ankle boot"),
    "cifar10": ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
    # The official fine labels; their label order happens to be alphabetical.
    "cifar100": (
        "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle",
        "bowl", "boy", "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle",
        "chair", "chimpanzee", "clock", "cloud", "cockroach", "couch", "crab", "crocodile", "cup",
        "dinosaur", "dolphin", "elephant", "flatfish", "forest", "fox", "girl", "hamster", "house",
        "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion", "lizard", "lobster", "man",
        "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange", "orchid",
        "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine",
        "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew",
        "skunk", "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower",
        "sweet_pepper", "table", "tank", "telephone", "television", "tiger", "tractor", "train", "trout",
        "tulip", "turtle", "wardrobe", "whale", "willow_tree", "wolf", "woman", "worm",
    ),
}


def class_names(dataset: str, num_classes: int) -> list[str]:
    """The dataset's class names, or ``class_0`` .. ``class_{n-1}`` for synthetic and unknown datasets."""
    names = CLASS_NAMES.get(dataset)
    if names is None:
        return [f"class_{i}" for i in range(num_classes)]
    # A count that disagrees with a known dataset is a bug upstream; wrong labels would be served silently.
    if len(names) != num_classes:
        raise ValueError(f"{dataset} has {len(names)} classes, not {num_classes}")
    return list(names)
