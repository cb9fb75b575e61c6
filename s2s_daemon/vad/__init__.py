"""Voice activity: microphone capture, the webrtcvad detector and the stage that runs them."""
