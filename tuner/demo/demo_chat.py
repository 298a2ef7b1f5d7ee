"""The closed-loop demo's chat traffic: an online shop's customer-service questions.

Daytime requests are detailed questions under the shop's system prompt (about
60 prompt tokens in SmolLM2's chat template); the promotion burst brings short
one-line questions (about 35). With the answers' lengths, that is the shift in
request length the sidecar follows.
"""

from __future__ import annotations

import numpy as np

__all__ = ["chat_messages"]

SYSTEM = "You are the support assistant of an online shop. Answer briefly and politely."
DAYTIME_QUESTIONS = (
    "I ordered running shoes last Tuesday and the tracking page still says the parcel is "
    "being prepared. When will it ship?",
    "My order arrived yesterday, but the blue jacket inside is the wrong size. How do I "
    "exchange it for a medium?",
    "I was charged twice for the same order this morning. How will the duplicate payment be "
    "refunded?",
    "I moved last week. Can I still change the delivery address of an order that has already "
    "shipped?",
    "The coffee grinder I bought two months ago stopped working. Is it still under warranty, "
    "and what should I do?",
    "I want to return a lamp I bought as a gift, but I no longer have the receipt. Is that "
    "possible?",
    "My newsletter discount code says it has expired, but the email said it is valid until the "
    "end of the month.",
    "The package was marked as delivered, but nothing was at my door and my neighbours have not "
    "seen it.",
    "Can I split the payment for a large order between my credit card and a gift card?",
    "I accidentally ordered the same book twice. Can you cancel one of them before it ships?",
    "How long does a refund take to reach my card after you receive the returned item?",
    "I need an invoice with my company's name and tax number for last month's order. How can I "
    "get one?",
)
PROMOTION_QUESTIONS = (
    "Is the sale still on?",
    "Do you ship to Canada?",
    "Where is my order?",
    "Can I pay with PayPal?",
    "Is shipping free?",
    "What sizes do you have?",
    "How do I use my coupon?",
    "When does the sale end?",
    "Can I return sale items?",
    "Is this in stock?",
    "Do you sell gift cards?",
    "What is your phone number?",
)


def chat_messages(phase: str, rng: np.random.Generator) -> list[dict]:
    """A conversation for one request of `phase` ("promo" or a daytime phase)."""
    if phase == "promo":
        return [{"role": "user", "content": str(rng.choice(PROMOTION_QUESTIONS))}]
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": str(rng.choice(DAYTIME_QUESTIONS))},
    ]
