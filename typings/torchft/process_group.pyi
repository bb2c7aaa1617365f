from torchft import ProcessGroupGloo as ProcessGroupGloo
